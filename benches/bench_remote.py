"""The shared tier (issue #10): every figure is a ratio against a baseline
timed in the same run, on a redis-server this script starts on a free
loopback port.

1. Time to first token on a second replica, resumed from the Redis tier
   (download into its empty directory, verification, load, suffix prefill,
   first argmax) vs a cold prefill. Target: <= 20% of cold.
2. Download throughput of a checkpoint (chunks streamed into a temp file
   with their digests checked) vs a plain pipelined ``GET`` of the same
   chunk keys into memory. Target: >= 0.8x.
3. Time to first token of a cold request that stores its cold prefix, with
   the background uploader on vs off. Target: within 5%.

    python benches/bench_remote.py [--engine llamacpp|reference] [--tokens N] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from bench_sessions import chat_prompt
from helpers.redis_servers import RedisNode

import ds4
from ds4.kvstore import KVStore
from ds4.kvstore.files import create_temp
from ds4.kvstore.remote import KeyLayout, RemoteTier


def _store(d, url=None, namespace="bench"):
    tier = RemoteTier(url, namespace=namespace) if url else None
    return KVStore(d, budget_mb=8192, min_tokens=16, remote=tier)


def ttft_remote(engine, url, n_tokens, repeats, ctx):
    hist, nxt = chat_prompt(engine, n_tokens)
    full = engine.tokenize(nxt, special=True)
    src = tempfile.mkdtemp(prefix="ds4-bench-a-")
    try:
        a = _store(src, url)
        s = ds4.Session(engine, ctx=ctx)
        s.sync(engine.tokenize(hist, special=True))
        path = a.store_live_prefix(s, "continued")
        a.remote.flush(120)
        assert a.remote.stats["uploads"] == 1, a.remote.status()
        a.close()
        size = os.path.getsize(path)

        def cold():
            c = ds4.Session(engine, ctx=ctx)
            t0 = time.perf_counter()
            c.sync(full)
            c.argmax()
            return time.perf_counter() - t0

        def resumed():
            d = tempfile.mkdtemp(prefix="ds4-bench-b-")  # a replica that never saw this conversation
            try:
                b = _store(d, url)
                r = ds4.Session(engine, ctx=ctx)
                t0 = time.perf_counter()
                rep = ds4.recover(r, b, nxt)
                r.argmax()
                dt = time.perf_counter() - t0
                assert rep.rung == "remote", rep.as_dict()
                b.close()
                return dt
            finally:
                shutil.rmtree(d, ignore_errors=True)

        tc, tr = [], []
        for _ in range(repeats):  # alternate, to spread the machine's noise over both
            tc.append(cold())
            tr.append(resumed())
        return len(full), size, statistics.median(tc), statistics.median(tr)
    finally:
        shutil.rmtree(src, ignore_errors=True)


def download_throughput(url, mib, repeats):
    """A checkpoint of ``mib`` MiB (random payload: what is timed is the
    transfer, not the model) uploaded once, then downloaded ``repeats``
    times each way, alternating."""
    import numpy as np

    from ds4.checkpoint import write_checkpoint

    src = tempfile.mkdtemp(prefix="ds4-bench-a-")
    dst = tempfile.mkdtemp(prefix="ds4-bench-b-")
    try:
        text = b"download throughput " * 10
        path = os.path.join(src, hashlib.sha1(text).hexdigest() + ".kv")
        payload = np.random.default_rng(0).integers(0, 255, mib * 2**20, dtype=np.uint8)
        write_checkpoint(
            path, text, {"tokens": np.arange(8, dtype=np.int32), "kv": payload}, abi="bench/1", tokens=8, ctx=64
        )
        tier = RemoteTier(url, namespace="download")
        assert tier.upload(path, "bench/1", 8, len(text)) == "stored"
        (entry,) = tier.entries("bench/1")
        keys = KeyLayout(tier.namespace, entry.abi)
        client = tier.client()

        def plain():
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for i in range(len(entry.digests)):
                pipe.get(keys.chunk(entry.sha, i))
            blobs = pipe.execute()
            assert sum(len(b) for b in blobs) == entry.size
            return time.perf_counter() - t0

        def ours():
            fd, tmp = create_temp(dst, entry.name)
            try:
                t0 = time.perf_counter()
                assert tier.fetch_file(entry, fd)
                return time.perf_counter() - t0
            finally:
                os.close(fd)
                os.unlink(tmp)

        tp, to = [], []
        for _ in range(repeats):
            tp.append(plain())
            to.append(ours())
        tier.close()
        return entry.size, len(entry.digests), statistics.median(tp), statistics.median(to)
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)


def ttft_uploader(engine, url, n_tokens, repeats, ctx):
    """A cold request with a cold save on the way (min_tokens 16: the save
    happens), the tier on vs off."""
    _, nxt = chat_prompt(engine, n_tokens)

    def run(with_tier, i):
        d = tempfile.mkdtemp(prefix="ds4-bench-u-")
        try:
            st = _store(d, url if with_tier else None, namespace=f"upload-{i}")  # a fresh namespace: nothing to load
            s = ds4.Session(engine, ctx=ctx)
            t0 = time.perf_counter()
            rep = ds4.recover(s, st, nxt, cold_save=True)
            s.argmax()
            dt = time.perf_counter() - t0
            assert rep.cold_saved, rep.as_dict()
            st.close()  # the upload finishes here, outside the timed part
            return dt
        finally:
            shutil.rmtree(d, ignore_errors=True)

    ton, toff = [], []
    for i in range(repeats):
        toff.append(run(False, i))
        ton.append(run(True, i))
    return statistics.median(toff), statistics.median(ton)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("llamacpp", "reference"), default="llamacpp")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=("ttft", "download", "uploader"), default=None, help="one measurement")
    ap.add_argument("--mib", type=int, default=44, help="checkpoint size for the download measurement")
    args = ap.parse_args()
    engine = ds4.LlamaCppEngine(n_threads=1) if args.engine == "llamacpp" else ds4.ReferenceEngine()
    ctx = 4096 if args.engine == "llamacpp" else max(4096, args.tokens * 2)
    work = tempfile.mkdtemp(prefix="ds4-bench-redis-")
    node = RedisNode(work).start()
    out = {"engine": engine.name, "tokens": args.tokens, "repeats": args.repeats}
    try:
        if args.only in (None, "ttft"):
            ttft_part(out, engine, node.url, args, ctx)
        if args.only in (None, "download"):
            download_part(out, node.url, args)
        if args.only in (None, "uploader"):
            uploader_part(out, engine, node.url, args, ctx)
    finally:
        node.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def ttft_part(out, engine, url, args, ctx):
    n, size, cold, resumed = ttft_remote(engine, url, args.tokens, args.repeats, ctx)
    out["ttft"] = {"prompt_tokens": n, "file_bytes": size, "cold_s": cold, "remote_s": resumed}
    print(
        f"TTFT {n} tokens ({size / 2**20:.1f} MiB): cold {cold:.3f} s, from Redis {resumed:.3f} s = "
        f"{100 * resumed / cold:.1f}% of cold (target <= 20%)",
        flush=True,
    )


def download_part(out, url, args):
    size, chunks, plain, ours = download_throughput(url, args.mib, max(5, args.repeats))
    out["download"] = {"bytes": size, "chunks": chunks, "plain_get_s": plain, "ds4_s": ours}
    print(
        f"download {size / 2**20:.1f} MiB in {chunks} chunks: plain pipelined GET {size / plain / 2**20:.0f} MiB/s, "
        f"ds4 (digests, temp file) {size / ours / 2**20:.0f} MiB/s = {plain / ours:.2f}x (target >= 0.8x)",
        flush=True,
    )


def uploader_part(out, engine, url, args, ctx):
    off, on = ttft_uploader(engine, url, args.tokens, args.repeats, ctx)
    out["uploader"] = {"off_s": off, "on_s": on}
    print(
        f"TTFT of a cold request with its cold save: uploader off {off:.3f} s, on {on:.3f} s = "
        f"{100 * (on / off - 1):+.1f}% (target within 5%)",
        flush=True,
    )


if __name__ == "__main__":
    main()
