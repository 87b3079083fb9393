"""What shared blocks save in the Redis tier (``--kv-remote`` with
``--kv-blocks on``): single checkpoint files against manifests and their
blocks, on SmolLM2 through llama.cpp, in the same run from the same states,
against one local ``redis-server`` (each arm in its own namespace).

* Replica A saves a session at each of T turns (reason ``continued``) and
  uploads each checkpoint: the bytes it uploads, and the bytes the tier
  holds at the end, as multiples of the final state's size.
* A fresh replica B resumes the last turn from the tier: the bytes it
  downloads and its time to the first token (download, verification,
  load and the suffix's prefill), blocks ÷ single; median of ``--repeats``
  fresh replicas.
* A then saves a second conversation under the same system prompt, and B
  (which holds the first) resumes it: the bytes B downloads for it.

::

    python benches/bench_remote_blocks.py [--turns 10] [--turn-tokens 340] [--repeats 3]

``redis-server`` must be installed (``scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import ds4
from ds4.kvstore.remote import RemoteTier

BLOCK = 64
CTX = 8192


def _words(turn: int, n: int) -> str:
    return " ".join(f"w{turn}x{i % 97}" for i in range(n))


def _replica(d: str, url: str, arm: str) -> ds4.KVStore:
    tier = RemoteTier(url, namespace=f"bench-{arm}")
    return ds4.KVStore(d, budget_mb=1 << 20, min_tokens=64, blocks=arm == "blocks", block_tokens=BLOCK, remote=tier)


def _held(url: str, arm: str) -> int:
    import redis

    c = redis.Redis.from_url(url)
    try:
        return sum(c.strlen(k) for k in c.scan_iter(match=f"ds4:{{bench-{arm}/*", count=1000) if c.type(k) == b"string")
    finally:
        c.close()


def _resume(eng, st: ds4.KVStore, prompt: str) -> tuple[float, ds4.RecoveryReport]:
    s = ds4.Session(eng, ctx=CTX)
    t0 = time.perf_counter()
    rep = ds4.recover(s, st, prompt, evict_save=False)
    s.argmax()
    return time.perf_counter() - t0, rep


def run(eng, url: str, turns: int, turn_tokens: int, repeats: int) -> dict:
    per_word = len(eng.tokenize(_words(0, 1000))) / 1000
    system = "".join(f"Rule {i}: answer briefly and cite {i}.py when it matters. " for i in range(60))
    texts, text = [], system
    for t in range(turns):
        text += f"<turn {t}> " + _words(t, int(turn_tokens / per_word)) + "\n"
        texts.append(text)
    second = system + "<other task> " + _words(99, int(turn_tokens / per_word))
    out: dict = {"turns": turns}
    with tempfile.TemporaryDirectory() as root:
        sess = ds4.Session(eng, ctx=CTX)
        for arm in ("single", "blocks"):
            a = _replica(os.path.join(root, arm, "a"), url, arm)
            final = 0
            for t in texts:
                ds4.recover(sess, None, t)
                path = a.store_live_checked(sess, "continued")
                assert isinstance(path, str), path
                final = os.path.getsize(path) if arm == "single" else final
            assert a.remote.flush(120)
            row: dict = {"uploaded": a.remote.stats["bytes_uploaded"], "held": _held(url, arm)}
            if arm == "single":
                out["final_state"], out["final_tokens"] = final, sess.n_past
            times, down = [], 0
            b = None
            for r in range(repeats):
                b = _replica(os.path.join(root, arm, f"b{r}"), url, arm)
                secs, rep = _resume(eng, b, texts[-1] + f" q{r}")
                assert rep.rung == "remote", rep.rung
                times.append(secs)
                down = b.remote.stats["bytes_downloaded"]
            row["ttft_ms"], row["downloaded_last"] = statistics.median(times) * 1000, down
            ds4.recover(sess, None, second)
            assert isinstance(a.store_live_checked(sess, "cold"), str)
            assert a.remote.flush(120)
            assert b is not None
            before = b.remote.stats["bytes_downloaded"]
            _, rep = _resume(eng, b, second + " q")
            assert rep.rung == "remote", rep.rung
            row["downloaded_second"] = b.remote.stats["bytes_downloaded"] - before
            out[arm] = row
            a.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=340)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from helpers.redis_servers import RedisNode

    eng = ds4.LlamaCppEngine()
    with tempfile.TemporaryDirectory() as rd:
        srv = RedisNode(rd).start()
        try:
            res = run(eng, srv.url, args.turns, args.turn_tokens, args.repeats)
        finally:
            srv.stop()
    f = res["final_state"]
    mib = 2**20
    print(f"{res['turns']} turns to {res['final_tokens']} tokens, final state {f / mib:.1f} MiB")
    for what in ("uploaded", "held", "downloaded_last", "downloaded_second"):
        s, b = res["single"][what], res["blocks"][what]
        print(
            f"  {what}: single {s / mib:.1f} MiB ({s / f:.2f} x final), blocks {b / mib:.1f} MiB "
            f"({b / f:.2f} x final), blocks ÷ single {b / s:.3f}"
        )
    s, b = res["single"]["ttft_ms"], res["blocks"]["ttft_ms"]
    print(f"  resume of the last turn from the tier: single {s:.0f} ms, blocks {b:.0f} ms (÷ {b / s:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
