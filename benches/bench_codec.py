#!/usr/bin/env python3
"""The payload codec as built (docs/FORMAT.md §1.10, issue 23 item 5): real
SmolLM2 and Gemma 3 states written and loaded through ds4, per codec.

    python benches/bench_codec.py [--tokens 1024] [--repeats 5] [--models smollm2,gemma3] [--no-redis]

For each model (the test suite's GGUFs through llama.cpp: tests/helpers/models.py)
one session is prefilled cold with ``tokens`` tokens of README.md's prose
and exported once. Then, per codec (``none``: v2; ``zstd-N``: v3 at level
N; ``shuffle2+`` the bytes of each f16 split first; 1 MiB frames), the same
arrays are written with :func:`ds4.checkpoint.write_checkpoint` and loaded
(:func:`ds4.checkpoint.open_checkpoint`, the whole verification pipeline,
then :meth:`ds4.Session.load_checkpoint`: the arrays' checks and llama.cpp's
import), repeated ``repeats`` times with the codecs interleaved, best of
each. Reported per codec: the file's bytes, and save, load (page cache hot)
and load (the file's pages dropped first with ``posix_fadvise(DONTNEED)``,
read from the disk) times, each also as a ratio against ``none`` in the
same run. With redis-server installed, each file is also uploaded through a
:class:`ds4.kvstore.RemoteTier` to a local redis-server and its
``bytes_uploaded`` counted: the shared tier's bytes on the wire.

Prints a table per model and one JSON line (prefix ``BENCH_JSON``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

#: name -> write_checkpoint's codec keywords
CODECS: dict[str, dict[str, object]] = {
    "none": {"codec": "none"},
    "zstd-1": {"codec": "zstd", "level": 1, "filter": "none"},
    "zstd-3": {"codec": "zstd", "level": 3, "filter": "none"},
    "shuffle2+zstd-1": {"codec": "zstd", "level": 1, "filter": "shuffle2"},
    "shuffle2+zstd-3": {"codec": "zstd", "level": 3, "filter": "shuffle2"},
}


def prefilled(model: str, tokens: int):
    from helpers.models import engine

    import ds4

    eng = engine(model)
    with open(os.path.join(HERE, "..", "README.md"), encoding="utf-8") as f:
        text = f.read()
    head = [eng.bos_token_id] if eng.add_bos else []
    toks = (head + eng.tokenize(text))[:tokens]
    assert len(toks) == tokens, f"README.md has {len(toks)} tokens"
    s = ds4.Session(eng, ctx=max(4096, 2 * tokens))
    s.sync(toks)
    return eng, s


def _drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _load(eng, sess_ctx: int, path: str, abi: str) -> float:
    import ds4
    from ds4.checkpoint import open_checkpoint

    t = ds4.Session(eng, ctx=sess_ctx)
    t0 = time.perf_counter()
    ck = open_checkpoint(path, expected_abi=abi)
    t.load_checkpoint(ck)
    dt = time.perf_counter() - t0
    t.invalidate("bench")
    return dt


def measure(model: str, tokens: int, repeats: int, work: str) -> dict[str, dict[str, float]]:
    from ds4.checkpoint import write_checkpoint

    eng, s = prefilled(model, tokens)
    arrays = s.export_arrays()
    text = s.key_bytes()
    name = __import__("hashlib").sha1(text).hexdigest() + ".kv"
    best: dict[str, dict[str, float]] = {c: {"save": 1e9, "load_hot": 1e9, "load_cold": 1e9} for c in CODECS}
    for _ in range(repeats):
        for c, kw in CODECS.items():
            d = os.path.join(work, model, c)
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, name)
            t0 = time.perf_counter()
            size = write_checkpoint(
                path, text, arrays, abi=s.payload_abi, tokens=s.n_past, ctx=s.ctx, drop_cache=False, **kw
            )  # type: ignore[arg-type]
            b = best[c]
            b["save"] = min(b["save"], time.perf_counter() - t0)
            b["bytes"] = size
            _load(eng, s.ctx, path, s.payload_abi)  # warm: the page cache holds the file
            b["load_hot"] = min(b["load_hot"], _load(eng, s.ctx, path, s.payload_abi))
            _drop_pages(path)
            b["load_cold"] = min(b["load_cold"], _load(eng, s.ctx, path, s.payload_abi))
    base = best["none"]
    for b in best.values():
        for k in ("bytes", "save", "load_hot", "load_cold"):
            b[f"{k}_vs_none"] = b[k] / base[k]
    return best


def wire_bytes(work: str, model: str) -> dict[str, int] | None:
    """Each codec's file uploaded to a local redis-server through the tier:
    its ``bytes_uploaded``."""
    if shutil.which("redis-server") is None:
        return None
    from helpers.redis_servers import RedisNode

    from ds4.kvstore import KVStore, RemoteTier

    out = {}
    srv = RedisNode(tempfile.mkdtemp(prefix="bench-codec-redis-")).start()
    try:
        for c in CODECS:
            with srv.client() as cl:
                cl.flushall()
            st = KVStore(os.path.join(work, model, c), remote=RemoteTier(srv.url))
            try:
                res = st.push()
                assert res.get("stored") == 1, res
                out[c] = int(st.remote.stats["bytes_uploaded"])
                files = [e.path for e in st.entries()]
                assert out[c] == sum(os.path.getsize(p) for p in files), "the tier moves the file as stored"
            finally:
                st.close()
    finally:
        srv.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--no-redis", action="store_true")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-codec-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    result: dict[str, object] = {}
    try:
        for model in a.models.split(","):
            res = measure(model, a.tokens, a.repeats, work)
            wire = None if a.no_redis else wire_bytes(work, model)
            result[model] = {"codecs": res, "wire_bytes": wire}
            print(f"{model}: {a.tokens} tokens, best of {a.repeats}")
            print(
                f"  {'codec':>16} {'file MiB':>9} {'/none':>6} {'save ms':>8} {'/none':>6} "
                f"{'load hot ms':>11} {'/none':>6} {'load cold ms':>12} {'/none':>6} {'wire bytes':>11}"
            )
            for c, r in res.items():
                w = "" if wire is None else str(wire[c])
                print(
                    f"  {c:>16} {r['bytes'] / 2**20:9.2f} {r['bytes_vs_none']:6.3f} {r['save'] * 1e3:8.1f} "
                    f"{r['save_vs_none']:6.2f} {r['load_hot'] * 1e3:11.1f} {r['load_hot_vs_none']:6.2f} "
                    f"{r['load_cold'] * 1e3:12.1f} {r['load_cold_vs_none']:6.2f} {w:>11}"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("BENCH_JSON " + json.dumps({"tokens": a.tokens, "repeats": a.repeats, "models": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
