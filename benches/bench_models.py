"""The second architecture (issue 20): Gemma 3 270M (sliding window) beside
SmolLM2-135M, every figure a ratio against a baseline timed in the same run.

1. Time to first token resumed from a disk checkpoint vs a cold prefill on
   Gemma 3 at about 1k, 4k and 8k tokens (the checkpoint holds the chat up
   to the last turn; the new turn is prefilled): ``bench_sessions.ttft``,
   the same path as SmolLM2's figure. Target: resumed <= 3% of cold at 4k.
2. Checkpoint bytes per token, Gemma 3 against SmolLM2, at the same token
   counts: the stored state's exact length (``state_layout.size``, which
   the tests check against exported blobs) and, for Gemma, the files the
   TTFT runs wrote.
3. Save and load of the same Gemma 3 state: ds4 vs llama-cpp-python's
   ``Llama.save_state``/``load_state`` (``bench_sessions.llama_save_load``).

    python benches/bench_models.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from bench_sessions import llama_save_load, ttft
from helpers.models import engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 repeats instead of 3")
    ap.add_argument("--json")
    a = ap.parse_args()
    reps = 2 if a.quick else 3
    gemma, smol = engine("gemma3"), engine("smollm2")
    out: dict = {"ttft": [], "bytes_per_token": [], "save_load": None}
    print(f"{'model':<8} {'prompt':>7} {'cold s':>8} {'resumed s':>10} {'resumed/cold':>13}")
    for n in (1024, 4096, 8192):
        nt, c, r = ttft(gemma, n, reps, ctx=n + 1024)
        out["ttft"].append({"model": "gemma3", "tokens": nt, "cold_s": c, "resumed_s": r, "ratio": r / c})
        print(f"{'gemma3':<8} {nt:>7} {c:>8.3f} {r:>10.3f} {r / c:>12.2%}", flush=True)
    print(f"\n{'tokens':>7} {'gemma3 B/token':>15} {'smollm2 B/token':>16} {'gemma/smollm2':>14}")
    for n in (512, 1024, 4096, 8192):
        g, s = gemma.state_layout.size(n) / n, smol.state_layout.size(n) / n
        out["bytes_per_token"].append({"tokens": n, "gemma3": g, "smollm2": s, "ratio": g / s})
        print(f"{n:>7} {g:>15.0f} {s:>16.0f} {g / s:>13.2f}x")
    sl = llama_save_load(gemma, 5 if not a.quick else 3)
    out["save_load"] = sl
    print(f"\nGemma 3 state, {sl['tokens']} tokens, ds4 file {sl['ds4_file_mib']:.1f} MiB")
    print(
        f"  save: ds4 {sl['ds4_save_s'] * 1e3:.1f} ms (durable), Llama.save_state {sl['llama_save_state_s'] * 1e3:.1f} ms (memory)"
    )
    print(
        f"  load: ds4 {sl['ds4_load_verify_s'] * 1e3:.1f} ms (verified), copy mode {sl['ds4_load_copy_s'] * 1e3:.1f} ms, "
        f"Llama.load_state {sl['llama_load_state_s'] * 1e3:.1f} ms = "
        f"{sl['llama_load_state_s'] / sl['ds4_load_verify_s']:.1f}x ds4's"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
