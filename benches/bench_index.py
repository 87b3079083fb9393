#!/usr/bin/env python3
"""The store at 1,000 to 100,000 checkpoints (issues 12 and 23): a fresh
process's open + first lookup against ds4's algorithm in C, the warm hit
against one SHA-1 pass over the prompt and against C, and the index's
memory, with M (how many stored texts are prefixes of the prompt) a
parameter.

    python benches/bench_index.py --n 10000 [--n 100000] [--m 0.5] [--prompt-kib 1024] [--dir DIR] [--repeats N]

Fixture: N checkpoints (v2, a 64-byte payload each) whose texts are 1 KiB
to the prompt's length (distinct lengths, uniform, seeded); M of them
(``--m``: a count, or a share of N when below 1; default 20) are prefixes
of the prompt, the others other texts (another head, 8 random bytes at
the end). The prompt is 64 random bytes and zeros, so every file is
written sparse (head, hole, tail, payload: about 8 KiB of disk each),
with the writer's header recomputed for its text; every file is a valid
checkpoint all the same (its name is the SHA-1 of its text, which reads as
zeros in the hole). The fixture is kept in DIR/N-M-KiB (default DIR: under
the system temp dir) and reused by later runs.

Rows (median of --repeats runs, warm page cache):

1. fresh process: ``KVStore(dir)`` + ``candidates(prompt).entries[0]``
   (timed inside a new Python process, after its imports), against
   ``ds4_find_prefix.c`` (ds4's directory rescan, 52-byte header reads and
   find_text_prefix, compiled here with ``cc -O2 ... -lcrypto``), timed
   inside its own process. Target at 10,000: ds4 / C <= 1.0.
   ``--no-fresh`` skips it (and 1b).
1b. whole process: the wall time of a child process from start to exit
   (interpreter start, ``import ds4``, open, first lookup, the answer
   printed) for ``python -m ds4 kv lookup DIR PROMPT_FILE`` and for the
   library's shortest script (``python -c``: ``from ds4.kvstore import
   KVStore``, open, ``candidates(prompt).entries[0]``, print), against the
   wall time of the C executable doing the same, alternated, medians of
   --repeats (at least 3). Target (issue 23, item 2): <= 1.0.
2. warm hit: ``KVStore.candidates(prompt)`` and its first entry (what the
   ladder pays for a hit, refresh included) against one SHA-1 of the
   whole prompt (``_core.sha1_hex``). Target: <= 1.5 (issue 23: at N =
   10,000 with M = 5,000 and N = 100,000 with M = 50,000).
3. ds4's C (its open + lookup: ds4 rescans the directory on every lookup)
   against the warm hit. Target: >= 50.
4. every stored prefix (``KVStore.lookup``, a list of M entries), against
   the same SHA-1 pass: reported.
5. the index's memory per entry: ``StoreIndex.heap_bytes()`` and the RSS
   growth of a process that loads the index file, each / N; the index
   file's bytes / N.

Prints a table and one JSON line (prefix ``BENCH_JSON``).
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import xxhash

import ds4
from ds4 import _core
from ds4.checkpoint import write_checkpoint
from ds4.kvstore import INDEX_NAME, KVStore

PROMPT_BYTES = 1 << 20
MATCHING = 20
HEAD = 64  # the random bytes at the start of every text (the rest is a hole)
HERE = os.path.dirname(os.path.abspath(__file__))


def _prompt(size: int = PROMPT_BYTES) -> bytes:
    """The prompt: 64 random bytes, then zeros (so a stored prefix of it can
    be written sparse: its text past the head is a hole)."""
    return np.random.default_rng(12).bytes(HEAD) + bytes(size - HEAD)


def _template() -> tuple[bytes, bytes, bytes]:
    """A checkpoint's fixed header, metadata and payload (64 bytes), as
    the writer makes them; a fixture file is this with its text fields."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "one.kv")
        write_checkpoint(path, b"t", {"kv": np.zeros(16, dtype=np.float32)}, abi="bench/1", tokens=1, ctx=1 << 30)
        with open(path, "rb") as f:
            raw = f.read()
    meta = int.from_bytes(raw[20:24], "little")
    return raw[:96], raw[96 : 96 + meta], raw[-64:]


def _write_sparse(path: str, tpl: tuple[bytes, bytes, bytes], text: tuple[bytes, bytes, int], sha: bytes) -> None:
    """One v2 checkpoint at ``path`` whose text is ``head``, a hole of zeros
    and ``tail`` (``length`` bytes in all; its SHA-1 ``sha``): the header
    is the template's with the text's fields and checksum (docs/FORMAT.md
    §1.2-1.3), the payload the template's."""
    fixed, meta, payload = tpl
    head, tail, length = text
    h = bytearray(fixed)
    h[8:12] = max(1, length // 4).to_bytes(4, "little")
    h[48:52] = length.to_bytes(4, "little")
    h[56:76] = sha
    z = bytearray(h)
    z[12:16], z[32:40], z[88:96] = bytes(4), bytes(8), bytes(8)
    h[88:96] = xxhash.xxh3_64_intdigest(bytes(z) + meta).to_bytes(8, "little")
    t0 = 96 + len(meta)
    p0 = (t0 + length + 63) // 64 * 64
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, bytes(h) + meta + head, 0)
        os.pwrite(fd, tail, t0 + length - len(tail))
        os.pwrite(fd, payload, p0)
    finally:
        os.close(fd)


def _digests(base: bytes, lengths: list[int], tails: dict[int, bytes] | None = None) -> dict[int, bytes]:
    """SHA-1 of ``base[:n]`` (or of ``base[:n - 8] + tails[n]``) for every
    ``n``, in one pass over ``base``."""
    h, fed, out = hashlib.sha1(), 0, {}
    for n in sorted(lengths):
        cut = n - 8 if tails else n
        h.update(base[fed:cut])
        fed = cut
        c = h.copy()
        if tails:
            c.update(tails[n])
        out[n] = c.digest()
    return out


def build_fixture(d: str, n: int, m: int, prompt: bytes) -> list[int]:
    """N checkpoints in ``d``, ``m`` of them prefixes of ``prompt`` (kept
    across runs: a marker file records N, M and the prompt's size); returns
    the lengths of the stored prefixes. Each text is 1 KiB to the prompt's
    length (distinct lengths, uniform, seeded); the others start with
    another head and end with 8 random bytes (the lookup's tail filter
    drops them). Every file is written sparse (head, hole, tail, payload)."""
    marker = os.path.join(d, "fixture.json")
    if os.path.exists(marker):
        with open(marker) as f:
            info = json.load(f)
        if (info["n"], info["m"], info["prompt"]) == (n, m, len(prompt)):
            return list(info["matching"])
        shutil.rmtree(d)
    os.makedirs(d, mode=0o700, exist_ok=True)
    rng = np.random.default_rng(n * 1_000_003 + m)
    lengths = [int(x) for x in rng.choice(np.arange(1024, len(prompt) + 1), n, replace=False)]
    matching = sorted(lengths[:m])
    others = lengths[m:]
    other = rng.bytes(HEAD) + bytes(len(prompt))
    tails = {x: rng.bytes(8) for x in others}
    tpl = _template()
    t0 = time.perf_counter()
    mine, theirs = _digests(prompt, matching), _digests(other, others, tails)
    for i, length in enumerate(lengths):
        if length in mine:
            text, sha = (prompt[:HEAD], prompt[length - 8 : length], length), mine[length]
        else:
            text, sha = (other[:HEAD], tails[length], length), theirs[length]
        _write_sparse(os.path.join(d, sha.hex() + ".kv"), tpl, text, sha)
        if i % 20000 == 19999:
            print(f"  fixture: {i + 1}/{n} files, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    with open(marker, "w") as f:
        json.dump({"n": n, "m": m, "prompt": len(prompt), "matching": matching}, f)
    return matching


_FRESH = r"""
import sys, time, json
from ds4.kvstore import KVStore
prompt = open(sys.argv[2], "rb").read()
t0 = time.perf_counter()
st = KVStore(sys.argv[1], budget_mb=1 << 30, min_tokens=1)
t1 = time.perf_counter()
best = st.candidates(prompt).entries[0]
t2 = time.perf_counter()
print(json.dumps({"open_ms": (t1 - t0) * 1e3, "lookup_ms": (t2 - t1) * 1e3, "best": best.text_bytes,
                  "files": st.summary()["files"], "rebuilds": st.stats["index_rebuilds"]}))
"""

#: the library's shortest path, as a user's script: import, open, first lookup, print
_LIB = (
    "import sys\n"
    "from ds4.kvstore import KVStore\n"
    "prompt = open(sys.argv[2], 'rb').read()\n"
    "best = KVStore(sys.argv[1], budget_mb=1 << 30, min_tokens=1).candidates(prompt).entries[0]\n"
    "print(best.name, best.text_bytes)\n"
)


def _wall(cmd: list[str]) -> tuple[float, str]:
    """Wall time (ms) of one whole child process, start to exit, and its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    ms = (time.perf_counter() - t0) * 1e3
    if p.returncode != 0:
        raise RuntimeError(f"{cmd} -> {p.returncode}: {p.stderr}")
    return ms, p.stdout


def whole_process(d: str, pfile: str, c_bin: str, best: int, repeats: int) -> dict[str, float]:
    """Row 1b: the wall time of a whole process (interpreter start, imports,
    open, first lookup, print, exit) for ``ds4 kv lookup DIR PROMPT_FILE``
    (``python -m ds4``), for the library's shortest script (``_LIB``) and
    for the C executable, alternated, medians in ms. Each answer is checked."""
    # the package's bytecode, as an installed one has it (an editable
    # install under PYTHONDONTWRITEBYTECODE would compile every module in
    # every child, a cost no installed ds4 pays)
    compileall.compile_dir(os.path.dirname(ds4.__file__), quiet=1)
    cli, lib, c = [], [], []
    for _ in range(max(3, repeats)):
        ms, out = _wall([sys.executable, "-m", "ds4", "kv", "lookup", d, pfile])
        assert f"text_bytes={best} " in out, out
        cli.append(ms)
        ms, out = _wall([sys.executable, "-c", _LIB, d, pfile])
        assert out.split()[1] == str(best), out
        lib.append(ms)
        ms, out = _wall([c_bin, d, pfile])
        assert out.split()[2] == str(best), out
        c.append(ms)
    med = statistics.median
    return {"cli_wall_ms": med(cli), "lib_wall_ms": med(lib), "c_wall_ms": med(c)}


_RSS = r"""
import sys, json
import ds4
from ds4 import _core
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
r0 = rss()
idx, _stamp = _core.StoreIndex.load(sys.argv[1])
idx.lookup(b"x", min_tokens=0)  # builds the lookup table too
r1 = rss()
print(json.dumps({"rss": r1 - r0, "heap": idx.heap_bytes(), "n": len(idx)}))
"""


def _run(cmd: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def _warm(st: KVStore, prompt: bytes, best: int, repeats: int) -> dict[str, float]:
    """The warm lookups against one SHA-1 pass of the prompt, alternated:
    the ladder's (``candidates`` and its first entry) and ``lookup`` (every
    stored prefix, as a list), medians in ms."""
    st.candidates(prompt).entries[0]
    hit, every, sha = [], [], []
    for _ in range(max(5, repeats * 3)):
        t0 = time.perf_counter()
        first = st.candidates(prompt).entries[0]
        hit.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _core.sha1_hex(prompt)
        sha.append(time.perf_counter() - t0)
        assert first.text_bytes == best
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        hits = st.lookup(prompt)
        every.append(time.perf_counter() - t0)
    assert hits[0].text_bytes == best
    med = lambda v: statistics.median(v) * 1e3  # noqa: E731
    return {"hit_ms": med(hit), "lookup_all_ms": med(every), "sha1_pass_ms": med(sha), "matches": len(hits)}


def bench(d: str, n: int, m: int, repeats: int, c_bin: str, prompt_bytes: int, fresh: bool) -> dict[str, object]:
    prompt = _prompt(prompt_bytes)
    t0 = time.perf_counter()
    matching = build_fixture(d, n, m, prompt)
    built = time.perf_counter() - t0
    pfile = os.path.join(d, "prompt.bin")
    with open(pfile, "wb") as f:
        f.write(prompt)
    # one open writes the index file (a rebuild from the headers when it is missing)
    t0 = time.perf_counter()
    first = KVStore(d, budget_mb=1 << 30, min_tokens=1)
    first_open_s = time.perf_counter() - t0
    rebuilt = first.stats["index_rebuilds"]
    del first
    ours, theirs = [], []
    for i in range(repeats * 2):  # alternated, so drift hits both
        if i % 2 == 0:
            if fresh:
                ours.append(json.loads(_run([sys.executable, "-c", _FRESH, d, pfile])))
        else:
            o, lk, best, files, hashed = _run([c_bin, d, pfile]).split()
            theirs.append(
                {
                    "open_ms": float(o),
                    "lookup_ms": float(lk),
                    "best": int(best),
                    "files": int(files),
                    "hashed": int(hashed),
                }
            )
    files = sum(1 for name in os.listdir(d) if name.endswith(".kv"))
    assert all(r["best"] == max(matching) and r["files"] == files and r["rebuilds"] == 0 for r in ours), ours
    assert all(r["best"] == max(matching) and r["files"] == files for r in theirs), theirs
    walls = whole_process(d, pfile, c_bin, max(matching), repeats) if fresh else {}
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    ours_total = statistics.median(r["open_ms"] + r["lookup_ms"] for r in ours) if ours else float("nan")
    c_total = statistics.median(r["open_ms"] + r["lookup_ms"] for r in theirs)

    st = KVStore(d, budget_mb=1 << 30, min_tokens=1)
    warm = _warm(st, prompt, max(matching), repeats)
    assert warm["matches"] == len(matching)
    mem = json.loads(_run([sys.executable, "-c", _RSS, os.path.join(d, INDEX_NAME)]))
    index_file = os.path.getsize(os.path.join(d, INDEX_NAME))
    return {
        "n": n,
        "m": m,
        "prompt_bytes": len(prompt),
        "files": files,
        "fixture_build_s": round(built, 1),
        "index_rebuild_s": round(first_open_s, 3) if rebuilt else None,
        "fresh_open_ms": med(ours, "open_ms") if ours else None,
        "fresh_lookup_ms": med(ours, "lookup_ms") if ours else None,
        "fresh_total_ms": ours_total,
        "c_open_ms": med(theirs, "open_ms"),
        "c_lookup_ms": med(theirs, "lookup_ms"),
        "c_total_ms": c_total,
        "c_hashed": theirs[0]["hashed"],
        "fresh_ratio": ours_total / c_total,
        **walls,
        "cli_wall_ratio": walls["cli_wall_ms"] / walls["c_wall_ms"] if walls else None,
        "lib_wall_ratio": walls["lib_wall_ms"] / walls["c_wall_ms"] if walls else None,
        "warm_hit_ms": warm["hit_ms"],
        "lookup_all_ms": warm["lookup_all_ms"],
        "sha1_pass_ms": warm["sha1_pass_ms"],
        "warm_ratio": warm["hit_ms"] / warm["sha1_pass_ms"],
        "lookup_all_ratio": warm["lookup_all_ms"] / warm["sha1_pass_ms"],
        # ds4's C rescans and hashes on every lookup: its open + lookup is its warm hit
        "c_over_warm": c_total / warm["hit_ms"],
        "heap_bytes_per_entry": mem["heap"] / files,
        "rss_bytes_per_entry": mem["rss"] / files,
        "index_file_bytes_per_entry": index_file / files,
    }


def _print(r: dict) -> None:
    n, m = r["n"], r["m"]
    print(
        f"== {n:,} checkpoints, {m:,} of them prefixes of the {r['prompt_bytes'] >> 10} KiB prompt "
        f"({r['files']:,} files; fixture built in {r['fixture_build_s']} s)"
    )
    if r["fresh_open_ms"] is not None:
        print(
            f"  fresh process open + first lookup: ds4 {r['fresh_total_ms']:.1f} ms "
            f"(open {r['fresh_open_ms']:.1f} + lookup {r['fresh_lookup_ms']:.1f}) vs C {r['c_total_ms']:.1f} ms: "
            f"{r['fresh_ratio']:.3f}x" + ("  target <= 1.0: " + ("PASS" if r["fresh_ratio"] <= 1.0 else "MISS"))
        )
    if r["cli_wall_ratio"] is not None:
        for what, k in (("ds4 kv lookup", "cli"), ("python -c (ds4.kvstore)", "lib")):
            ratio = r[f"{k}_wall_ratio"]
            print(
                f"  whole process, {what}: {r[f'{k}_wall_ms']:.1f} ms vs the C executable {r['c_wall_ms']:.1f} ms: "
                f"{ratio:.3f}x  target <= 1.0: " + ("PASS" if ratio <= 1.0 else "MISS")
            )
    print(
        f"  warm hit (candidates + first entry) {r['warm_hit_ms']:.3f} ms vs one SHA-1 pass {r['sha1_pass_ms']:.3f} ms:"
        f" {r['warm_ratio']:.2f}x  target <= 1.5: {'PASS' if r['warm_ratio'] <= 1.5 else 'MISS'}"
    )
    print(
        f"  ds4's C (rescan + lookup, {r['c_hashed']} prefixes hashed) {r['c_total_ms']:.1f} ms / warm hit: "
        f"{r['c_over_warm']:.0f}x  target >= 50: {'PASS' if r['c_over_warm'] >= 50 else 'MISS'}"
    )
    print(f"  every stored prefix (KVStore.lookup) {r['lookup_all_ms']:.3f} ms: {r['lookup_all_ratio']:.2f}x a pass")
    print(
        f"  index memory: heap {r['heap_bytes_per_entry']:.0f} B/entry, RSS {r['rss_bytes_per_entry']:.0f} B/entry;"
        f" file {r['index_file_bytes_per_entry']:.0f} B/entry"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, action="append", help="checkpoints in the fixture (repeatable)")
    ap.add_argument(
        "--m", type=float, default=MATCHING, help=f"how many are prefixes of the prompt (< 1: a share of N; {MATCHING})"
    )
    ap.add_argument("--prompt-kib", type=int, default=PROMPT_BYTES >> 10)
    ap.add_argument("--no-fresh", action="store_true", help="skip the fresh-process rows")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ds4-bench-index"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    sizes = args.n or [10000]
    c_bin = os.path.join(tempfile.mkdtemp(prefix="ds4-c-"), "ds4_find_prefix")
    subprocess.run(["cc", "-O2", "-o", c_bin, os.path.join(HERE, "ds4_find_prefix.c"), "-lcrypto"], check=True)
    rows = []
    for n in sizes:
        m = int(args.m * n) if args.m < 1 else int(args.m)
        d = os.path.join(args.dir, f"{n}-{m}-{args.prompt_kib}")
        rows.append(bench(d, n, m, args.repeats, c_bin, args.prompt_kib << 10, not args.no_fresh))
        _print(rows[-1])
    print("BENCH_JSON " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
