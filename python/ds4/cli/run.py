"""``ds4 run``: one turn from a prompt, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import build_engine, check_kv_args, make_store
from ..constrain import Constraint
from ..errors import ConstraintError, ContextOverflowError, EmptyPromptError
from ..turn import GenParams, GenResult, TurnDriver
from .progress import ProgressBar
from .term import EXIT_FAIL, EXIT_OK, EXIT_USAGE, printable

__all__ = ["cmd_run"]


def cmd_run(args: argparse.Namespace) -> int:
    msg = check_kv_args(args)
    if msg:
        print(f"ds4 run: {msg}", file=sys.stderr)
        return EXIT_USAGE
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text:
        print("ds4 run: the prompt is empty", file=sys.stderr)
        return EXIT_USAGE
    try:
        constraint = _json_schema(args.json_schema)
    except (OSError, UnicodeDecodeError, ConstraintError) as e:
        print(f"ds4 run: --json-schema {args.json_schema}: {e}", file=sys.stderr)
        return EXIT_USAGE
    store = make_store(args)
    engine = build_engine(args.engine, args.model, args.threads, getattr(args, "exact", None))
    gen = TurnDriver(engine, args.ctx, store)
    if args.raw:
        prompt = text
    else:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}
        ]
        prompt = engine.render_chat(msgs)
    params = GenParams(
        max_tokens=args.max_tokens,
        stop=tuple(args.stop or ()),
        temperature=args.temperature,
        seed=args.seed,
        constraint=constraint,
    )
    bar = ProgressBar()
    streaming = not args.json

    def on_text(s: str) -> None:
        if streaming:
            sys.stdout.write(printable(s) if sys.stdout.isatty() else s)
            sys.stdout.flush()

    try:
        # the bar is erased before the answer starts: its line is the answer's on a terminal
        res = gen.generate(prompt, params, on_start=lambda _rep: bar.close(), on_text=on_text, progress=bar)
    except (ContextOverflowError, EmptyPromptError) as e:
        bar.close()
        print(f"ds4 run: {e}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        bar.close()
        if store is not None:
            store.close()  # the shared tier's queued uploads finish first
    _report(args, res)
    return EXIT_OK


def _json_schema(path: str | None) -> Constraint | None:
    """The constraint of ``--json-schema FILE`` (None without the flag)."""
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return Constraint.json_schema(f.read())


def _report(args: argparse.Namespace, res: GenResult) -> None:
    if args.json:
        out = {
            "text": res.text,
            "tokens": res.tokens,
            "finish_reason": res.finish_reason,
            "usage": res.usage(),
            "timings": {"ttft_s": res.ttft_s, "decode_s": res.decode_s, "total_s": res.total_s},
            "report": res.report.as_dict(),
        }
        print(json.dumps(out, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    if args.verbose:
        r = res.report
        tps = res.completion_tokens / res.decode_s if res.decode_s > 0 else 0.0
        print(
            f"[rung={r.rung} source={r.source} cached={r.reused_tokens} prompt={res.prompt_tokens} "
            f"gen={res.completion_tokens} finish={res.finish_reason} ttft={res.ttft_s * 1000:.0f} ms {tps:.1f} tok/s]",
            file=sys.stderr,
        )
