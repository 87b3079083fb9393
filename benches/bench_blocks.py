"""What shared blocks save (``--kv-blocks on``): single checkpoint files
against a manifest and its blocks, on SmolLM2 through llama.cpp, in the
same run from the same states.

* A session saved at each of T turns (each turn about ``--turn-tokens``
  tokens more, reason ``continued``, nothing superseded: an agent session
  whose every turn boundary is kept): bytes written, bytes on disk at the
  end, both as multiples of the final state's size (one file of it);
  the save latency of the last turn's checkpoint (single ÷ blocks).
* A disk resume (a new session, the store opened again, the page cache
  warm in both arms) of the turn nearest 2k tokens and of the last:
  time to the first token (less any save the ladder makes on the way: an
  engine that cannot rewind stores its prompt after a resume), blocks ÷
  single; with a key (MACs) too, keyed ÷ plain within each arm.
* K subagents under one system prompt of about 2,000 tokens, each saved
  once: the unique bytes on disk, and their ratio to one conversation's.

::

    python benches/bench_blocks.py [--model smollm2|gemma3] [--turns 20] [--turn-tokens 380] [--agents 4] [--repeats 3]

SmolLM2's context is 8k: its session ends near 7.6k tokens; the 16k row
is Gemma 3 270M's (``--model gemma3 --turn-tokens 800``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import ds4
from ds4 import _core

BLOCK = 64
CTX = 8192  # set by main: the model's training context, at most 32k


def _words(turn: int, n: int) -> str:
    return " ".join(f"w{turn}x{i % 97}" for i in range(n))


def _store(d: str, blocks: bool, key: bytes | None = None) -> ds4.KVStore:
    return ds4.KVStore(d, budget_mb=1 << 20, min_tokens=64, blocks=blocks, block_tokens=BLOCK, auth_key=key)


def _disk_bytes(d: str) -> int:
    return sum(
        os.path.getsize(os.path.join(r, f)) for r, _ds, fs in os.walk(d) for f in fs if f.endswith((".kv", ".kvb"))
    )


def _ttft(eng, d: str, blocks: bool, prompt: str, key: bytes | None, repeats: int) -> tuple[float, int]:
    """Median time from a new session to its first token, over a store
    opened again each time, without the saves the ladder makes on the way
    (an engine that cannot rewind, Gemma 3's sliding window, stores its
    prompt's state after a resume: each repeat's prompt is its own, so every
    repeat loads the same checkpoint); and the tokens the resume reused."""
    times, reused = [], 0
    for i in range(repeats):
        store = _store(d, blocks, key)
        saving = [0.0]
        save = store.store_live_checked

        def timed(*a, _save=save, _spent=saving, **kw):
            t = time.perf_counter()
            try:
                return _save(*a, **kw)
            finally:
                _spent[0] += time.perf_counter() - t

        store.store_live_checked = timed  # type: ignore[method-assign]
        s = ds4.Session(eng, ctx=CTX)
        t0 = time.perf_counter()
        rep = ds4.recover(s, store, f"{prompt}{i}", evict_save=False)
        s.argmax()
        times.append(time.perf_counter() - t0 - saving[0])
        reused = rep.reused_tokens
    return statistics.median(times), reused


def session_arm(eng, turns: int, turn_tokens: int, repeats: int) -> dict:
    key = _core.derive_auth_key(b"bench")
    with tempfile.TemporaryDirectory() as root:
        dirs = {arm: os.path.join(root, arm) for arm in ("single", "blocks", "single_k", "blocks_k")}
        stores = {
            arm: _store(d, arm.startswith("blocks"), key if arm.endswith("_k") else None) for arm, d in dirs.items()
        }
        sess = ds4.Session(eng, ctx=CTX)
        per_word = len(eng.tokenize(_words(0, 1000))) / 1000
        text, prompts, sizes, save_s = "", [], [], {"single": 0.0, "blocks": 0.0}
        for t in range(turns):
            text += f"<turn {t}> " + _words(t, int(turn_tokens / per_word)) + "\n"
            ds4.recover(sess, None, text)
            for arm, st in stores.items():
                t0 = time.perf_counter()
                path = st.store_live_checked(sess, "continued")
                if arm in save_s and t == turns - 1:
                    save_s[arm] = time.perf_counter() - t0
                assert isinstance(path, str), path
                if arm == "single":  # the tokens the checkpoint holds: a resume of its text reuses them all
                    sizes.append(os.path.getsize(path))
                    prompts.append((ds4.open_checkpoint(path, load_payload=False).tokens, text))
        final = sizes[-1]
        written = {"single": sum(sizes), "blocks": stores["blocks"].blocks.counts["bytes_written"]}
        written["blocks"] += sum(e.size for e in stores["blocks"].entries())  # the manifests, each written once
        out = {
            "turns": turns,
            "final_tokens": prompts[-1][0],
            "final_state_mib": final / 2**20,
            "written_x_final": {a: w / final for a, w in written.items()},
            "disk_x_final": {a: _disk_bytes(dirs[a]) / final for a in ("single", "blocks")},
            "save_last_ms": {a: s * 1000 for a, s in save_s.items()},
        }
        near2k = min(prompts, key=lambda p: abs(p[0] - 2048))
        for label, (n, p) in (("2k", near2k), ("last", prompts[-1])):
            row = {"tokens": n}
            for arm in dirs:
                secs, reused = _ttft(
                    eng, dirs[arm], arm.startswith("blocks"), p + " q", key if arm.endswith("_k") else None, repeats
                )
                assert reused == n, (arm, reused, n)
                row[arm] = secs * 1000
            out[f"ttft_ms_{label}"] = row
        return out


def agents_arm(eng, agents: int) -> dict:
    """K subagents under one system prompt, each saved once (reason cold):
    the unique bytes on disk per arm, against one conversation's alone and
    against the goal's allowance (one conversation's plus every other
    one's own suffix, at the single file's bytes a token)."""
    system = "".join(
        f"Rule {i}: keep the answer to the point and cite the file {i}.py when it matters. " for i in range(110)
    )
    with tempfile.TemporaryDirectory() as root:
        out: dict = {}
        ids: list[list[int]] = []
        for arm in ("single", "blocks"):
            d = os.path.join(root, arm)
            store = _store(d, arm == "blocks")
            one = 0
            for k in range(agents):
                msgs = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Agent {k}: " + _words(k, 60)},
                ]
                s = ds4.Session(eng, ctx=CTX)
                ds4.recover(s, None, eng.render_chat(msgs))
                assert isinstance(store.store_live_checked(s, "cold"), str)
                if arm == "single":
                    ids.append(s.tokens)
                if k == 0:
                    one = _disk_bytes(d)
            out[arm] = {"unique_mib": _disk_bytes(d) / 2**20, "x_one": _disk_bytes(d) / one}
            if arm == "single":
                per_token = one / len(ids[0])
                common = min(
                    next((i for i, (x, y) in enumerate(zip(ids[0], t, strict=False)) if x != y), len(t))
                    for t in ids[1:]
                )
                out["prompt_tokens"], out["shared_tokens"] = len(ids[0]), common
                allowance = one + sum((len(t) - common) * per_token for t in ids[1:])
        out["blocks"]["x_allowance"] = out["blocks"]["unique_mib"] * 2**20 / allowance
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--turn-tokens", type=int, default=380)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    global CTX
    if args.model == "gemma3":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from helpers import models

        eng = ds4.LlamaCppEngine(models.gemma_path())
    else:
        eng = ds4.LlamaCppEngine()
    CTX = min(32768, eng.max_ctx)
    res = {
        "session": session_arm(eng, args.turns, args.turn_tokens, args.repeats),
        "agents": agents_arm(eng, args.agents),
    }
    s = res["session"]
    print(f"session: {s['turns']} turns, {s['final_tokens']} tokens, final state {s['final_state_mib']:.1f} MiB")
    print("  written ÷ final: single {single:.2f}, blocks {blocks:.2f}".format(**s["written_x_final"]))
    print("  on disk ÷ final: single {single:.2f}, blocks {blocks:.2f}".format(**s["disk_x_final"]))
    sv = s["save_last_ms"]
    print(
        f"  last continued save: single {sv['single']:.0f} ms, blocks {sv['blocks']:.0f} ms, blocks ÷ single {sv['blocks'] / sv['single']:.3f}"
    )
    for label in ("2k", "last"):
        r = s[f"ttft_ms_{label}"]
        print(
            f"  disk resume at {r['tokens']} tokens: single {r['single']:.0f} ms, blocks {r['blocks']:.0f} ms "
            f"(÷ {r['blocks'] / r['single']:.2f}); keyed ÷ plain: single {r['single_k'] / r['single']:.2f}, "
            f"blocks {r['blocks_k'] / r['blocks']:.2f}"
        )
    a = res["agents"]
    print(
        f"agents: {args.agents} of {a['prompt_tokens']} tokens sharing {a['shared_tokens']}: "
        f"single {a['single']['unique_mib']:.1f} MiB ({a['single']['x_one']:.2f} x one), "
        f"blocks {a['blocks']['unique_mib']:.1f} MiB ({a['blocks']['x_one']:.2f} x one, "
        f"{a['blocks']['x_allowance']:.2f} x one plus the others' own suffixes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
