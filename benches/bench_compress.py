#!/usr/bin/env python3
"""How compressible real KV states are, per codec (issue 23, item 5: the
measurement a payload codec's default is chosen by).

    python benches/bench_compress.py [--tokens 1024] [--chunk-mib 1] [--models smollm2,gemma3]

For each model (SmolLM2-135M and Gemma 3 270M through llama.cpp, the
test suite's GGUFs: tests/helpers/models.py) one session is prefilled cold with
``tokens`` tokens of README.md's prose, and its exported arrays (what a
checkpoint's payload holds: llama.cpp's state blob, the logits, the tokens)
are cut into ``chunk-mib`` chunks, each compressed on its own (what a
chunked, streaming codec stores: a load can stop at the first bad chunk).
Per codec: the stored bytes over the raw bytes, and the time to compress
and to decompress every chunk (best of 3), as ratios against the same
run's xxh3-64 pass over the raw payload (best of 10: the checksum every
uncompressed load already pays). ``shuffle2`` splits each chunk into its even and odd bytes first
(the low and high bytes of llama.cpp's f16 K/V cells). The shared tier's
bytes on the wire are the stored bytes.

Prints a table per model and one JSON line (prefix ``BENCH_JSON``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import lz4.frame
import numpy as np
import xxhash
import zstandard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

Codec = tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]


def _shuffle2(b: bytes) -> bytes:
    a = np.frombuffer(b, dtype=np.uint8)
    n = len(a) // 2 * 2
    return a[:n:2].tobytes() + a[1:n:2].tobytes() + a[n:].tobytes()


def _unshuffle2(b: bytes) -> bytes:
    a = np.frombuffer(b, dtype=np.uint8)
    n = len(a) // 2
    out = np.empty(n * 2, dtype=np.uint8)
    out[0::2], out[1::2] = a[:n], a[n : 2 * n]
    return out.tobytes() + a[2 * n :].tobytes()


def codecs() -> dict[str, Codec]:
    def zstd(level: int) -> Codec:
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        return c.compress, d.decompress

    z1, z3 = zstd(1), zstd(3)
    return {
        "lz4": (lz4.frame.compress, lz4.frame.decompress),
        "lz4-hc9": (lambda b: lz4.frame.compress(b, compression_level=9), lz4.frame.decompress),
        "zstd-1": z1,
        "zstd-3": z3,
        "zstd-9": zstd(9),
        "shuffle2+zstd-1": (lambda b: z1[0](_shuffle2(b)), lambda b: _unshuffle2(z1[1](b))),
        "shuffle2+zstd-3": (lambda b: z3[0](_shuffle2(b)), lambda b: _unshuffle2(z3[1](b))),
    }


def state_payload(model: str, tokens: int) -> bytes:
    from helpers.models import engine

    import ds4

    eng = engine(model)
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "README.md"), encoding="utf-8") as f:
        text = f.read()
    head = [eng.bos_token_id] if eng.add_bos else []
    toks = (head + eng.tokenize(text))[:tokens]
    assert len(toks) == tokens, f"README.md has {len(toks)} tokens"
    s = ds4.Session(eng, ctx=max(4096, 2 * tokens))
    s.sync(toks)
    arrays = s.export_arrays()
    return b"".join(np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes() for a in arrays.values())


def _best(fn: Callable[[], object], n: int) -> float:
    """The fastest of ``n`` runs of ``fn`` (the one the shared machine disturbed least)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(payload: bytes, chunk: int) -> dict[str, dict[str, float]]:
    chunks = [payload[i : i + chunk] for i in range(0, len(payload), chunk)]
    base = _best(lambda: xxhash.xxh3_64_intdigest(payload), 10)
    out: dict[str, dict[str, float]] = {"xxh3-64 (baseline)": {"ratio": 1.0, "compress": 0.0, "decompress": 1.0}}
    for name, (comp, decomp) in codecs().items():
        stored = [comp(c) for c in chunks]
        assert b"".join(decomp(c) for c in stored) == payload, name
        tc = _best(lambda comp=comp: [comp(c) for c in chunks], 3)
        td = _best(lambda decomp=decomp, stored=stored: [decomp(c) for c in stored], 3)
        out[name] = {
            "ratio": sum(map(len, stored)) / len(payload),
            "compress": tc / base,
            "decompress": td / base,
            "compress_mb_s": len(payload) / tc / 1e6,
            "decompress_mb_s": len(payload) / td / 1e6,
        }
    out["xxh3-64 (baseline)"]["decompress_mb_s"] = len(payload) / base / 1e6
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--models", default="smollm2,gemma3")
    a = ap.parse_args()
    result = {}
    for model in a.models.split(","):
        payload = state_payload(model, a.tokens)
        res = measure(payload, int(a.chunk_mib * 2**20))
        result[model] = {"payload_bytes": len(payload), "codecs": res}
        print(f"{model}: {a.tokens} tokens, payload {len(payload) / 2**20:.1f} MiB, chunks of {a.chunk_mib} MiB")
        print(f"  {'codec':>20} {'stored/raw':>10} {'compress':>9} {'decompress':>11}  (times / one xxh3-64 pass)")
        for name, r in res.items():
            print(f"  {name:>20} {r['ratio']:10.3f} {r['compress']:9.1f} {r['decompress']:11.1f}")
    print("BENCH_JSON " + json.dumps({"tokens": a.tokens, "chunk_mib": a.chunk_mib, "models": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
