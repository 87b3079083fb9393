"""Four ``ds4 serve`` replicas behind a round-robin client (issue #10):
40 conversations x 4 turns, each turn's conversations in a shuffled order
so that a conversation's next turn usually lands on another replica.
Prefilled tokens (prompt tokens minus cached tokens, summed over every
request) without a shared tier vs with one Redis behind the four.

    python benches/bench_fleet.py [--engine reference|llamacpp] [--conversations 40] [--turns 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from helpers.redis_servers import RedisNode
from helpers.server import KV_FLAGS, Server, cached_tokens, topic_chat

N_SERVERS = 4


def conversation(c, turn):
    msgs = topic_chat(f"subject{c}", 24)
    for t in range(turn):
        msgs += [{"role": "assistant", "content": f"Noted, part {t}."}, {"role": "user", "content": f"Go on ({t})."}]
    return msgs


def run(work, engine, url, n_conv, n_turns):
    tag = "shared" if url else "alone"
    extra = ["--kv-remote", url] if url else []
    servers = [
        Server(work, f"{tag}{i}", "--kv-disk-dir", os.path.join(work, f"kv-{tag}{i}"), *KV_FLAGS, *extra, engine=engine)
        for i in range(N_SERVERS)
    ]
    for s in servers:
        s.start(timeout=300)
    try:
        model = servers[0].model()
        clients = [s.client() for s in servers]
        prompt = cached = n = 0
        remote = 0
        t0 = time.perf_counter()
        for turn in range(n_turns):
            order = list(range(n_conv))
            random.Random(turn).shuffle(order)
            for c in order:
                srv = n % N_SERVERS
                n += 1
                r = clients[srv].chat.completions.create(model=model, messages=conversation(c, turn), max_tokens=2)
                prompt += r.usage.prompt_tokens
                cached += cached_tokens(r)
                remote += (r.model_extra or {}).get("ds4", {}).get("rung") == "remote"
        return {
            "requests": n,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefilled_tokens": prompt - cached,
            "remote_hits": remote,
            "seconds": time.perf_counter() - t0,
        }
    finally:
        for s in servers:
            s.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("reference", "llamacpp"), default="reference")
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ds4-bench-fleet-")
    node = RedisNode(work).start()
    try:
        alone = run(work, args.engine, None, args.conversations, args.turns)
        shared = run(work, args.engine, node.url, args.conversations, args.turns)
    finally:
        node.stop()
    for name, r in (("without the tier", alone), ("with one Redis", shared)):
        print(
            f"{name}: {r['requests']} requests, {r['prompt_tokens']} prompt tokens, "
            f"{r['prefilled_tokens']} prefilled ({100 * r['prefilled_tokens'] / r['prompt_tokens']:.1f}%), "
            f"{r['remote_hits']} remote hits, {r['seconds']:.1f} s"
        )
    print(f"prefilled with / without: {shared['prefilled_tokens'] / alone['prefilled_tokens']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": args.engine, "alone": alone, "shared": shared}, f, indent=1)


if __name__ == "__main__":
    main()
