"""The ``ds4`` command.

::

    ds4 serve  [--host --port --engine --model --ctx --kv-disk-dir ...]   OpenAI-compatible server
    ds4 run    -p TEXT [--max-tokens N] [--raw] [--json] [--json-schema F]  one-shot generation
    ds4 chat   [--system TEXT] [--kv-disk-dir DIR] ...                      interactive REPL
    ds4 kv     ls|show|verify|gc|rm|stats DIR [...] [--json]                inspect a checkpoint directory
    ds4 kv     lookup DIR PROMPT_FILE [--json]                           the longest stored prefix of a prompt
    ds4 kv     stats DIR --plot FILE.png|-                                  its pictures (a PNG, or terminal bars)
    ds4 kv     ls|stats|verify|gc|rm --remote URL, push|pull DIR --remote URL   the shared tier
    ds4 bench  [--tokens N] [--model PATH] [--json]                         headline figures on this machine
    ds4 demo   [--engine ...] [--model PATH]                                the end-to-end demo

Each command is a module of this package (run, chat, kv, bench), imported
when the command runs; they stand on :mod:`ds4.turn`, :mod:`ds4.config`,
:mod:`ds4.recovery` and :mod:`ds4.kvstore`, never on the HTTP server. The
parser itself needs only :mod:`ds4.config` (and :mod:`ds4.serve_args`
when it builds ``ds4 serve``'s flags: :func:`build_parser` builds only the
named command's), so ``ds4 kv`` loads no server module, no turn
driver, no engine and no llguidance; ``ds4 serve`` imports the server when
it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from .term import EXIT_FAIL, EXIT_OK, EXIT_USAGE

__all__ = ["DEFAULT_SYSTEM", "build_parser", "main"]

#: ``ds4 chat``'s system prompt without ``--system``
DEFAULT_SYSTEM = "You are a helpful assistant."


def _gen_args(q: argparse.ArgumentParser, max_tokens: int) -> None:
    q.add_argument(
        "--max-tokens", type=int, default=max_tokens, metavar="N", help=f"tokens to generate (default {max_tokens})"
    )
    q.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    q.add_argument("--seed", type=int, default=None, help="sampling seed")


def tenant_share(s: str) -> float:
    """``--tenant-share F``: in (0, 1], as ``ds4 serve --kv-tenant-share``
    takes it (anything else exits 2, argparse's usage error)."""
    try:
        f = float(s)
    except ValueError:
        f = float("nan")
    if not 0.0 < f <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {s!r}")
    return f


def _config() -> ModuleType:
    """:mod:`ds4.config`, the flags' definitions (imported by the builders
    that use it: ``ds4 kv lookup``'s parser needs none of them)."""
    from .. import config

    return config


SHARE_HELP = "each tenant's share of the budget, as ds4 serve --kv-tenant-share F (0 < F <= 1)"


VERIFY_HELP = "run the full verification (what a load would decide); else headers only, marked unverified"


#: ``--model PATH`` of ``kv ls`` and ``kv prune``
MODEL_HELP = "only the checkpoints of this GGUF file (the fingerprint their payload ABI records)"


def _kv_ls(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir", nargs="?", help="directory (not with --remote)")
    _config().add_remote_args(k)
    k.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    k.add_argument("--model", metavar="PATH", default=None, help=MODEL_HELP)
    k.add_argument("--json", action="store_true")


def _kv_prune(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir", help="directory")
    k.add_argument("--model", metavar="PATH", required=True, help=MODEL_HELP)
    k.add_argument("--dry-run", action="store_true", help="list what would go")
    k.add_argument("--json", action="store_true")


def _kv_show(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir", help="directory (or a checkpoint file)")
    k.add_argument("name", nargs="?", help="file name or unique hex prefix")
    k.add_argument("--text", action="store_true", help="print the whole text")
    k.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    k.add_argument("--json", action="store_true")


def _kv_verify(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir", nargs="?", help="directory (or a checkpoint file; not with --remote)")
    k.add_argument("names", nargs="*", help="only these files (names or unique prefixes)")
    _config().add_remote_args(k)
    k.add_argument("--json", action="store_true")


def _kv_gc(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir", nargs="?", help="directory (not with --remote)")
    _config().add_remote_args(k)
    k.add_argument("--budget-mb", type=float, default=None, help="evict (ds4's score) until the directory fits")
    k.add_argument(
        "--tmp-age", type=float, default=3600, help="temp files older than this (s) are orphans (default 3600)"
    )
    k.add_argument("--quarantine-dir", default=None, help="move corrupt files here instead of deleting")
    k.add_argument(
        "--tenant-share",
        type=tenant_share,
        default=None,
        metavar="F",
        help=SHARE_HELP + ": a tenant over it loses its own checkpoints first (with --budget-mb; default 1)",
    )
    _config().add_policy_args(k)  # ds4 serve's own flags: gc evicts in the server's order
    # None when not given: a directory's gc takes the server's defaults, and
    # with --remote (whose TTL evicts, not this order) a given one is refused
    k.set_defaults(kv_explicit_weight=None, kv_fresh_guard_s=None)
    k.add_argument("--dry-run", action="store_true")
    k.add_argument("--json", action="store_true")


def _kv_lookup(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir", help="directory")
    k.add_argument("prompt_file", metavar="PROMPT_FILE", help="the prompt's key text (its bytes, as stored)")
    k.add_argument("--json", action="store_true")


def _kv_rm(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir", nargs="?", help="directory (with --remote: the first name)")
    _config().add_remote_args(k)
    k.add_argument("names", nargs="*", help="file names or unique hex prefixes")
    k.add_argument("--all", action="store_true", help="every checkpoint in the directory")
    k.add_argument("--json", action="store_true")


def _kv_stats(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir", nargs="?", help="directory (not with --remote)")
    _config().add_remote_args(k)
    k.add_argument("--tenant-share", type=tenant_share, default=None, metavar="F", help=SHARE_HELP + ": who is over it")
    k.add_argument(
        "--budget-mb",
        type=float,
        default=None,
        help=f"the budget the shares are of (default {_config().DEFAULT_BUDGET_MB:g}, ds4 serve's --kv-disk-space-mb)",
    )
    k.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    k.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw bytes by reason and tenant, checkpoints by age and hits: a PNG (needs ds4[plot]), "
        "or - for bars on the terminal",
    )
    k.add_argument("--json", action="store_true")


def _kv_push(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir")
    _config().add_remote_args(k, required=True)
    k.add_argument("--kv-trust-dir", action="store_true", help="a directory owned by another user")
    k.add_argument("--json", action="store_true")


def _kv_pull(k: argparse.ArgumentParser) -> None:
    k.add_argument("dir")
    k.add_argument("names", nargs="*", help="only these (names or unique prefixes)")
    _config().add_remote_args(k, required=True)
    k.add_argument("--kv-trust-dir", action="store_true", help="a directory owned by another user")
    k.add_argument("--json", action="store_true")


#: ``ds4 kv``'s actions, in its help's order: (help, the builder of its flags)
KV_ACTIONS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "ls": ("list checkpoints", _kv_ls),
    "show": ("one checkpoint's header, tensors and text", _kv_show),
    "verify": ("run the full verification pipeline on every file (exit 1 on any failure)", _kv_verify),
    "gc": ("remove corrupt and orphaned temp files; evict to a budget", _kv_gc),
    "lookup": ("the longest stored prefix of a prompt (exit 0 on a hit, 1 on a miss)", _kv_lookup),
    "rm": ("remove checkpoints", _kv_rm),
    "prune": ("remove one model's checkpoints (--model PATH), nothing else", _kv_prune),
    "stats": ("totals by version, reason, ABI and tenant", _kv_stats),
    "push": ("upload a directory's checkpoints to the shared tier", _kv_push),
    "pull": ("download (and verify) the shared tier's checkpoints into a directory", _kv_pull),
}


def _kv_args(kp: argparse.ArgumentParser, action: str | None) -> None:
    """``ds4 kv``'s actions; only ``action``'s flags when it is named."""
    ksub = kp.add_subparsers(dest="kvcmd", metavar="ACTION")
    for name, (help_, build) in KV_ACTIONS.items():
        k = ksub.add_parser(name, help=help_)
        if action is None or action == name:
            build(k)


def _serve_args(sp: argparse.ArgumentParser) -> None:
    from ..serve_args import add_serve_args  # ds4 serve's flags: built only for it

    add_serve_args(sp)


def _run_args(rp: argparse.ArgumentParser) -> None:
    rp.add_argument("-p", "--prompt", required=True, help="the prompt ('-' reads stdin)")
    rp.add_argument("--raw", action="store_true", help="use the prompt as is (no chat template)")
    rp.add_argument("--system", default=None, help="a system message (chat mode)")
    rp.add_argument("--stop", action="append", metavar="TEXT", help="stop sequence (repeatable)")
    rp.add_argument("--json", action="store_true", help="print {text, tokens, report, ...} as JSON")
    rp.add_argument(
        "--json-schema", metavar="FILE", default=None, help="constrain the answer to JSON valid under this JSON Schema"
    )
    rp.add_argument("-v", "--verbose", action="store_true", help="print the ladder report to stderr")
    _gen_args(rp, 128)
    _config().add_engine_args(rp)
    _config().add_kv_args(rp)


def _chat_args(cp: argparse.ArgumentParser) -> None:
    cp.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt (its checkpoint is reused across sessions)")
    cp.add_argument("--no-kv-cache", action="store_true", help="no checkpoint directory")
    _gen_args(cp, 512)
    _config().add_engine_args(cp)
    _config().add_kv_args(cp, dir_default=os.environ.get("DS4_KV_DIR") or os.path.join("~", ".cache", "ds4", "kv"))


def _bench_args(bp: argparse.ArgumentParser) -> None:
    bp.add_argument(
        "--engine",
        choices=_config().ENGINE_KINDS,
        default=None,
        help="the session figures' engine (default: reference, or llamacpp with --model)",
    )
    bp.add_argument("--model", metavar="PATH", help="GGUF model file: the session figures run on it through llama.cpp")
    bp.add_argument("--threads", type=int, default=None, metavar="N", help="engine threads (llamacpp)")
    bp.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="prompt length (default 4096; with --concurrency the system prompt, 2000)",
    )
    bp.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="K",
        help="K conversations interleaved against a pool of K sessions, and against one session, in one run",
    )
    bp.add_argument("--turns", type=int, default=6, help="with --concurrency: turns per conversation (default 6)")
    bp.add_argument("--max-tokens", type=int, default=32, help="with --concurrency: tokens per reply (default 32)")
    bp.add_argument("--sha-mb", type=int, default=64, help="MiB hashed for the SHA-1 figures (default 64)")
    bp.add_argument("--kv-disk-dir", default=None, help="directory for the checkpoint (default: a temp dir)")
    bp.add_argument("--json", action="store_true")


def _demo_args(dp: argparse.ArgumentParser) -> None:
    dp.add_argument("demo_args", nargs=argparse.REMAINDER)


#: the commands, in ``ds4 --help``'s order: (help, the builder of its flags)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "serve": ("OpenAI-compatible HTTP server (a pool of live sessions, disk KV cache)", _serve_args),
    "run": ("generate once from a prompt", _run_args),
    "chat": ("interactive chat with named checkpoints (/save /list /switch /new /clear /quit)", _chat_args),
    "kv": ("inspect a checkpoint directory (ds4 v1, v2 and v3 files, manifests and their blocks)", lambda kp: None),
    "bench": ("headline figures on this machine (reference engine, or --model PATH)", _bench_args),
    "demo": ("the end-to-end demo: cold prefill + save, restart + resume, corruption + recovery", _demo_args),
}


def named(argv: Sequence[str] | None) -> tuple[str | None, str | None]:
    """The command and the ``ds4 kv`` action ``argv`` names, each None when
    it names none (then the parser builds every one)."""
    words = list(argv or ())
    cmd = words[0] if words and words[0] in COMMANDS else None
    action = words[1] if cmd == "kv" and len(words) > 1 and words[1] in KV_ACTIONS else None
    return cmd, action


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``ds4`` parser. Given the command line it will parse, it builds
    only the flags of the command (and ``ds4 kv`` action) that line names:
    the other commands are there by name and help, so ``ds4 kv lookup``
    builds neither ``ds4 serve``'s flags nor imports their module. Without
    ``argv`` (or when it names no command) every command's flags are built."""
    cmd, action = named(argv)
    p = argparse.ArgumentParser(prog="ds4", description="ds4: LLM inference with a verified disk KV cache")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, (help_, build) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, add_help=name != "demo")
        if name == "kv":
            _kv_args(sp, action if cmd == "kv" else None)
        elif cmd is None or cmd == name:
            build(sp)
    return p


def _command(args: argparse.Namespace) -> Callable[[argparse.Namespace], int] | None:
    """The function that runs ``args.cmd`` (imported on demand: ``ds4 kv``
    never loads an engine, ``ds4 run`` never loads the HTTP server)."""
    if args.cmd == "serve":
        from ..server.serve import serve_main

        return serve_main
    if args.cmd == "run":
        from .run import cmd_run

        return cmd_run
    if args.cmd == "chat":
        from .chat import cmd_chat

        return cmd_chat
    if args.cmd == "bench" and args.concurrency is not None:  # K conversations against a pool
        from .bench_pool import cmd_bench_concurrency

        return cmd_bench_concurrency
    if args.cmd == "bench":
        from .bench import cmd_bench

        return cmd_bench
    if getattr(args, "remote", None):
        return _remote_command(args)
    if getattr(args, "kvcmd", None) and getattr(args, "dir", "") is None:
        return _usage(f"ds4 kv {args.kvcmd}: give a directory (or --remote URL)")
    if args.kvcmd == "lookup":  # the store alone: no inspection module
        from .kvlookup import kv_lookup

        return kv_lookup
    from .kv import KV_COMMANDS

    return KV_COMMANDS.get(args.kvcmd)


def _usage(msg: str) -> Callable[[argparse.Namespace], int]:
    def fail(_args: argparse.Namespace) -> int:
        print(msg, file=sys.stderr)
        return EXIT_USAGE

    return fail


def _remote_command(args: argparse.Namespace) -> Callable[[argparse.Namespace], int] | None:
    """``ds4 kv ACTION --remote URL``: the shared tier's action. rm and
    verify take names (the first lands in ``dir``); the others no directory,
    except push and pull, whose directory is the local side."""
    from .kvremote import REMOTE_COMMANDS

    if getattr(args, "tenant_share", None) is not None or getattr(args, "budget_mb", None) is not None:
        if args.kvcmd == "stats":
            return _usage("ds4 kv stats --remote: --tenant-share and --budget-mb are a directory's")
    if args.kvcmd == "stats" and getattr(args, "plot", None) is not None:
        return _usage("ds4 kv stats --remote: --plot draws a directory's checkpoints")
    if args.kvcmd == "gc" and getattr(args, "tenant_share", None) is not None:
        return _usage("ds4 kv gc --remote: --tenant-share is a directory's (the tier's TTL evicts)")
    if args.kvcmd == "gc" and (args.kv_explicit_weight is not None or args.kv_fresh_guard_s is not None):
        return _usage(
            "ds4 kv gc --remote: --kv-explicit-weight and --kv-fresh-guard-s order a directory's eviction "
            "(the tier's TTL evicts)"
        )
    if args.kvcmd in ("rm", "verify"):
        args.names = ([args.dir] if args.dir else []) + list(args.names)
    elif args.kvcmd not in ("push", "pull") and args.dir is not None:
        return _usage(f"ds4 kv {args.kvcmd} --remote: no directory (the tier is the URL)")
    return REMOTE_COMMANDS.get(args.kvcmd)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # its own argument parser (python -m ds4.demo)
        from ..demo import main as demo_main

        return demo_main(argv[1:])
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.version:
        from .. import __version__

        print(f"ds4 {__version__}")
        return EXIT_OK
    if args.cmd is None:
        parser.print_help()
        return EXIT_USAGE
    fn = _command(args)
    if fn is None:
        parser.parse_args(["kv", "--help"])
        return EXIT_USAGE
    try:
        return fn(args)
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return EXIT_OK
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except Exception as e:  # engine construction and the like: one line, not a traceback
        from ..errors import Ds4Error

        if isinstance(e, (Ds4Error, ValueError, OSError)):
            print(f"ds4 {args.cmd}: {e}", file=sys.stderr)
            return EXIT_FAIL
        raise
