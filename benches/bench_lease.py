"""What the lease and the windowed checksum cost on a 44 MiB payload (the
size of SmolLM2's 2k-token state): open with full verification, one copy
out of the map (what llama_state_set_data does), release. Run it against
two checkouts alternately to compare them (docs/BENCHMARKS.md):

    PYTHONPATH=python python3 benches/bench_lease.py this
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import ds4


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "ds4"
    d = tempfile.mkdtemp(prefix="ds4-bench-lease-")
    try:
        text = b"lease bench " * 100
        p = os.path.join(d, hashlib.sha1(text).hexdigest() + ".kv")
        payload = np.random.default_rng(0).integers(0, 255, 44 << 20, dtype=np.uint8)
        ds4.write_checkpoint(p, text, {"s": payload}, abi="b/1", tokens=1, ctx=8)
        dst = np.empty(44 << 20, np.uint8)

        def one() -> float:
            t = time.perf_counter()
            ck = ds4.open_checkpoint(p, prompt=text)
            dst[:] = ck.array("s")  # one copy out of the map
            if hasattr(ck, "release"):  # older checkouts have no lease
                ck.release()
            return time.perf_counter() - t

        for _ in range(3):
            one()
        ts = [one() for _ in range(15)]
        print(label, f"median {statistics.median(ts) * 1e3:.1f} ms")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
