"""``ds4 serve``'s flags, defined apart from the server: the ``ds4``
command builds its whole parser from this module and :mod:`ds4.config`
without importing :mod:`ds4.server` (which loads Starlette's side of the
house, :mod:`ds4.turn` and llguidance). The server takes its defaults from
here (the SSE keepalive, the volatile modes) and reads the flags in
``serve_main``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from .config import add_engine_args, add_kv_args
from .snapshots import DEFAULT_COUNT, DEFAULT_EVERY, DEFAULT_MB

__all__ = ["SSE_KEEPALIVE_S", "VOLATILE_MODES", "add_guard_args", "add_serve_args", "regex"]

#: a keepalive comment at least this often while a stream has nothing to say
SSE_KEEPALIVE_S = 2.0
#: what ``--prompt-volatile-mode`` takes (:class:`ds4.server.volatile.SystemText`)
VOLATILE_MODES = ("drop", "tail")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``ds4 serve`` (``ds4.server.app.serve_main`` reads them)."""
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
    p.add_argument(
        "--sessions",
        type=_sessions,
        default="auto",
        metavar="N|auto",
        help="resident live sessions, each its own engine context of --ctx tokens: a request goes to the one "
        "holding its prefix, and up to N requests run at once, taking turns token by token "
        "(docs/DESIGN.md, 'Session pool'); auto (the default): as many as fit in --sessions-mem-mb (at least 1, "
        "at most 8); 1: one resident, every switch between conversations saved and resumed from disk",
    )
    p.add_argument(
        "--sessions-mem-mb",
        type=float,
        default=None,
        metavar="MB",
        help="memory for the resident sessions' contexts (each measured at start): --sessions auto fills it, "
        "an explicit N must fit (default for auto: a quarter of the available memory)",
    )
    p.add_argument(
        "--batch-decode",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --sessions > 1 on llama.cpp: the residents' decode steps in one llama_decode, where this "
        "build gives bit-identical logits (checked at start; docs/DESIGN.md, 'Batched decode'). auto (the "
        "default): where it also pays (always with --exact strict; with canonical only for a decode pad of "
        "one token: SmolLM2 yes, Gemma 3 no); on: wherever exact; off: each resident decodes in its own context",
    )
    p.add_argument(
        "--batch-prefill",
        choices=("on", "off"),
        default="off",
        help="with batched decode: the residents' prefill pieces in one llama_decode too, as exact "
        "(off, the default: on 2 cores it buys no throughput and turns that finish apart finish together; "
        "docs/DESIGN.md, 'Batched decode')",
    )
    g = p.add_argument_group("RAM snapshots where a state cannot rewind (recurrent, hybrid, windowed imports)")
    g.add_argument(
        "--ctx-checkpoints",
        type=_at_least_zero(int),
        default=DEFAULT_COUNT,
        metavar="N",
        help=f"snapshots each session keeps at turn boundaries and every --ctx-checkpoint-every tokens; "
        f"an edited turn resumes from the newest at or before it (default {DEFAULT_COUNT}; 0: off)",
    )
    g.add_argument(
        "--ctx-checkpoints-mb",
        type=_at_least_zero(float),
        default=DEFAULT_MB,
        metavar="MB",
        help=f"memory the snapshots of one session may take (default {DEFAULT_MB})",
    )
    g.add_argument(
        "--ctx-checkpoint-every",
        type=_at_least_zero(int),
        default=DEFAULT_EVERY,
        metavar="N",
        help=f"a snapshot every N tokens of a prefill too (default {DEFAULT_EVERY}; 0: turn boundaries only)",
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
    p.add_argument(
        "--no-metrics",
        action="store_true",
        help="no GET /metrics (Prometheus), GET /ui (the web page) nor /ui/data, and no per-turn observation for them",
    )
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
        type=regex,
        metavar="REGEX",
        help="lines of system text this matches (re.search; repeatable) are dropped or moved to the prompt's tail "
        "(--prompt-volatile-mode); never user or assistant text",
    )
    g.add_argument(
        "--prompt-volatile-mode",
        choices=VOLATILE_MODES,
        default="drop",
        help="drop: the lines are removed; tail: they become a system turn after the last message, in their "
        "order (default drop)",
    )
    g.add_argument(
        "--prompt-transient",
        action="append",
        default=[],
        type=regex,
        metavar="REGEX",
        help="spans of user and tool messages this matches (re.DOTALL; repeatable), with the white space around "
        "them, are taken out before rendering (--prompt-transient-mode): per-turn text agents inject",
    )
    g.add_argument(
        "--prompt-transient-builtin",
        action="store_true",
        help="add the known clients' spans: <system-reminder>...</system-reminder> (Claude Code), "
        "<environment_details>...</environment_details> (Cline, Roo Code)",
    )
    g.add_argument(
        "--prompt-transient-mode",
        choices=VOLATILE_MODES,
        default="drop",
        help="drop (default): every span is removed; tail: the current request's own spans go into a system turn "
        "after the last message (the model sees them; the chat template must accept a system turn there, Gemma's "
        "does not), older messages' are dropped",
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
    p.add_argument(
        "--divergence-text",
        choices=("off", "own", "all"),
        default="own",
        help="the texts of the ds4 block's divergence: 'own' (default) shows the stored side's 32 bytes to the "
        "operator (an --admin-tenant key, or everyone without keys) and to a tenant only when they are its own "
        "conversation (the live state of its last turn, same routing hint); 'all' to everyone; 'off' to nobody "
        "(offsets only)",
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
    g.add_argument(
        "--shutdown-grace",
        type=int,
        default=30,
        metavar="S",
        help="on SIGTERM, running requests get S s to finish (default 30); one second before, each still running "
        "gets a final error (a stream: its protocol's error event, then [DONE] on chat) and its job stops",
    )


def regex(s: str) -> str:
    """A ``--prompt-volatile`` pattern, compiled once to check it."""
    try:
        re.compile(s)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{s!r} is not a valid regular expression: {e}") from None
    return s


def add_guard_args(p: argparse.ArgumentParser) -> None:
    """``ds4 serve``'s access flags."""
    g = p.add_argument_group("access (docs/DESIGN.md, 'The server's security model')")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY", help="a key clients must send (repeatable)")
    g.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="a file of keys, one a line: 'name:key' names the key's tenant, a bare 'key' gets a digest ('#' comments)",
    )
    g.add_argument(
        "--admin-tenant",
        action="append",
        default=[],
        metavar="NAME",
        help="a tenant whose keys see the operator's /health (server-wide counters, live session, store); "
        "other keys see their own (repeatable; without keys every request sees it)",
    )
    g.add_argument(
        "--insecure-no-auth", action="store_true", help="allow a non-loopback --host without any key (not recommended)"
    )
    g.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host header to accept besides the loopback names and --host ('*': any; repeatable)",
    )
    g.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin browsers may call from ('*': any)",
    )


def _sessions(v: str) -> int | str:
    """``--sessions``: a count of at least 1, or ``auto``."""
    if v == "auto":
        return v
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {v!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("--sessions must be >= 1")
    return n


def _at_least_zero(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a number of ``kind``, at least 0."""

    def parse(v: str) -> float:
        try:
            n = kind(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None
        if not n >= 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
        return n

    return parse
