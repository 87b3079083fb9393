"""Reliability campaigns (issue #5), longer than the test suite's versions.
Results go into docs/RELIABILITY.md.

    python scripts/campaign.py crash --trials 200
    python scripts/campaign.py concurrency --procs 4 --ops 500
    python scripts/campaign.py corrupt --seconds 600

crash:        a writer storing real sessions through KVStore (incl. eviction)
              is SIGKILLed at a random moment; then the directory is checked:
              every *.kv verifies and loads into a session whose state equals
              a cold prefill of its text; temp files are gone after the next
              KVStore open; the index agrees with the directory.
concurrency:  N processes x M mixed operations (store, lookup+load, now and then
              through a store opened fresh from the shared index file, hit
              updates, eviction) on one directory with a small budget; every
              load is compared with a cold prefill; the budget holds at rest.
corrupt:      random damage (bit flips, truncation, splices, overwrites,
              appended bytes) to real session checkpoints, and crafted files
              whose checksums are all correct but whose contents lie (shapes,
              dtypes, missing or extra tensors, tokens that do not render the
              text, token counts, token ids, another conversation's tokens),
              then the public ladder: it must either serve exactly the cold
              state or reject with a typed CheckpointError; anything else is
              a failure, and so is a rejection that is only the catch-all
              import_failed (an untyped error from below).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ds4

WRITER = r"""
import os, sys, random
import ds4
d, seed = sys.argv[1], int(sys.argv[2])
rnd = random.Random(seed)
eng = ds4.ReferenceEngine()
st = ds4.KVStore(d, budget_mb=6, min_tokens=8)
print("ready", flush=True)
i = 0
while True:
    k = rnd.randrange(40)
    s = ds4.Session(eng, ctx=8192)
    s.sync(eng.tokenize(("crash conversation %d " % k) * (40 + 8 * k), special=True))
    print("w", flush=True)  # a store starts now: the parent aims its kill here
    st.store_live_prefix(s, "cold")
    i += 1
"""


def _cold(eng, text, cache):
    if text not in cache:
        c = ds4.Session(eng, ctx=8192)
        c.sync(eng.tokenize(text, special=True))
        cache[text] = (c.tokens, np.array(c.logits))
    return cache[text]


def crash(args):
    eng = ds4.ReferenceEngine()
    cold = {}
    texts = {
        ds4._core.sha1_hex((f"crash conversation {k} " * (40 + 8 * k)).encode()): f"crash conversation {k} "
        * (40 + 8 * k)
        for k in range(40)
    }
    d = tempfile.mkdtemp(prefix="ds4-crash-")
    stats = {"trials": 0, "files_checked": 0, "temp_files_cleaned": 0, "bad": []}
    t0 = time.time()
    for trial in range(args.trials):
        p = subprocess.Popen([sys.executable, "-c", WRITER, d, str(trial)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        rnd = random.Random(trial)
        if trial % 2 == 0:
            # aim inside a store: after the k-th "w", within the write window
            for _ in range(rnd.randrange(1, 4)):
                p.stdout.readline()
            time.sleep(rnd.uniform(0.0, 0.02))
        else:
            time.sleep(rnd.uniform(0.0, 0.8))  # anywhere
        p.send_signal(signal.SIGKILL)
        p.wait()
        stats["trials"] += 1
        stats["temp_files_cleaned"] += len([f for f in os.listdir(d) if ".tmp." in f])
        st = ds4.KVStore(d, budget_mb=6, min_tokens=8)  # the next open
        if [f for f in os.listdir(d) if ".tmp." in f]:
            stats["bad"].append(f"trial {trial}: temp file left after open")
        on_disk = sorted(f for f in os.listdir(d) if f.endswith(".kv"))
        if sorted(e.name for e in st.entries()) != on_disk:
            stats["bad"].append(f"trial {trial}: index disagrees with directory")
        for f in on_disk:
            text = texts[f[:40]]
            s = ds4.Session(eng, ctx=8192)
            try:
                s.load_checkpoint(ds4.open_checkpoint(os.path.join(d, f), prompt=text, expected_abi=eng.payload_abi()))
            except Exception as e:
                stats["bad"].append(f"trial {trial}: {f} does not load: {e}")
                continue
            toks, logits = _cold(eng, text, cold)
            if s.tokens != toks or not np.array_equal(s.logits, logits):
                stats["bad"].append(f"trial {trial}: {f} loads a WRONG state")
            stats["files_checked"] += 1
    stats["seconds"] = round(time.time() - t0, 1)
    shutil.rmtree(d, ignore_errors=True)
    return stats


def _worker(d, wid, n_ops, q):
    rnd = random.Random(wid)
    eng = ds4.ReferenceEngine()
    st = ds4.KVStore(d, budget_mb=2, min_tokens=8)
    texts = [f"shared conversation {k} " * (6 + 3 * k) for k in range(16)]
    cold, problems = {}, []
    counts = {"store": 0, "load": 0, "hit": 0, "miss": 0, "touch": 0, "evict": 0, "reopen": 0}
    for _ in range(n_ops):
        t = rnd.choice(texts)
        op = rnd.random()
        try:
            if op < 0.35:
                s = ds4.Session(eng, ctx=4096)
                s.sync(eng.tokenize(t, special=True))
                st.store_live_prefix(s)
                counts["store"] += 1
            elif op < 0.85:
                counts["load"] += 1
                if rnd.random() < 0.1:  # a fresh store, opened from the shared index file
                    st = ds4.KVStore(d, budget_mb=2, min_tokens=8)
                    counts["reopen"] += 1
                s = ds4.Session(eng, ctx=4096)
                res = ds4.recovery.try_load_text(st, s, t + " and then?")
                if res is None:
                    counts["miss"] += 1
                else:
                    counts["hit"] += 1
                    toks, logits = _cold(eng, t, cold)
                    if s.tokens != toks or not np.array_equal(s.logits, logits):
                        problems.append("WRONG state loaded")
            elif op < 0.95:
                for e in st.entries()[:2]:
                    try:
                        ds4._core.touch(e.path, int(time.time()))
                        counts["touch"] += 1
                    except FileNotFoundError:
                        counts["miss"] += 1
            else:
                st.evict()
                counts["evict"] += 1
        except Exception as e:
            problems.append(f"{type(e).__name__}: {e}")
    q.put((wid, problems, counts, dict(st.stats)))


def concurrency(args):
    d = tempfile.mkdtemp(prefix="ds4-conc-")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    t0 = time.time()
    ps = [ctx.Process(target=_worker, args=(d, i, args.ops, q)) for i in range(args.procs)]
    for p in ps:
        p.start()
    res = [q.get() for _ in ps]
    for p in ps:
        p.join()
    st = ds4.KVStore(d, budget_mb=2)
    st.evict()
    files = [f for f in os.listdir(d) if f.endswith(".kv")]
    total = sum(os.path.getsize(os.path.join(d, f)) for f in files)
    bad = [f for f in files if not _verifies(os.path.join(d, f))]
    out = {
        "procs": args.procs,
        "ops_per_proc": args.ops,
        "seconds": round(time.time() - t0, 1),
        "problems": [p for _, ps_, _, _ in res for p in ps_],
        "counts": {k: sum(c[k] for _, _, c, _ in res) for k in res[0][2]},
        "at_rest_bytes": total,
        "budget_bytes": 2 * 2**20,
        "files_failing_verification": bad,
        "temp_files": [f for f in os.listdir(d) if ".tmp" in f],
        "index_matches_files": sorted(e.name for e in ds4.KVStore(d, budget_mb=2).entries()) == sorted(files),
    }
    shutil.rmtree(d, ignore_errors=True)
    return out


def _verifies(p):
    try:
        ds4.open_checkpoint(p)
        return True
    except ds4.errors.CheckpointError:
        return False


DAMAGE = ["flip", "truncate", "splice", "overwrite", "append", "multi"]
# Crafted files: written by the real writer (every checksum right) under the
# real name and text, each telling one lie the load must catch.
CRAFTED = [
    "shape_transpose",
    "shape_flat",
    "shape_short",
    "dtype",
    "tensor_missing",
    "tensor_extra",
    "tokens_changed",
    "tokens_other",
    "tokens_count",
    "tokens_negative",
    "tokens_vocab",
    "header_tokens",
    "logits_shape",
]


def _craft(kind, rnd, arrays, n_tokens, other, vocab):
    """(arrays, header tokens) of a file lying in the way ``kind`` says."""
    a = {k: np.array(v) for k, v in arrays.items()}
    kv = [k for k in a if k not in ("tokens", "logits")]
    name = rnd.choice(kv)
    toks = a["tokens"]
    if kind == "shape_transpose":
        a[name] = np.ascontiguousarray(np.swapaxes(a[name], 0, -1))
    elif kind == "shape_flat":
        a[name] = a[name].reshape(-1)
    elif kind == "shape_short":
        a[name] = a[name][:-1]
    elif kind == "dtype":
        a[name] = a[name].astype(rnd.choice([np.float64, np.float16, np.int32]))
    elif kind == "tensor_missing":
        del a[name]
    elif kind == "tensor_extra":
        a["unexpected"] = np.zeros(3, np.float32)
    elif kind == "tokens_changed":
        i = rnd.randrange(len(toks))
        toks[i] = (int(toks[i]) + rnd.randrange(1, 50)) % vocab
    elif kind == "tokens_other":  # another conversation's tokens, this text and state
        a["tokens"] = np.resize(other, len(toks)).astype(np.int32)
    elif kind == "tokens_count":
        a["tokens"] = toks[: rnd.randrange(1, len(toks))]
    elif kind == "tokens_negative":
        toks[rnd.randrange(len(toks))] = -rnd.randrange(1, 1000)
    elif kind == "tokens_vocab":
        toks[rnd.randrange(len(toks))] = vocab + rnd.randrange(0, 1000)
    elif kind == "header_tokens":
        return a, n_tokens + rnd.choice([-1, 1, 7])
    else:  # logits_shape
        a["logits"] = a["logits"][: rnd.randrange(1, len(a["logits"]))]
    return a, n_tokens


def _damage(kind, rnd, b, blobs):
    """``b`` damaged in the way ``kind`` says (bit rot, torn and mixed writes)."""
    if kind == "flip":
        pos = rnd.randrange(len(b))
        b[pos] ^= 1 << rnd.randrange(8)
    elif kind == "truncate":
        del b[rnd.randrange(len(b)) :]
    elif kind == "splice":
        o = blobs[rnd.randrange(len(blobs))]
        cut = rnd.randrange(min(len(b), len(o)))
        b = b[:cut] + o[cut:]
    elif kind == "overwrite":
        pos = rnd.randrange(len(b))
        b[pos : pos + 16] = bytes(rnd.randrange(256) for _ in range(16))
    elif kind == "append":
        b += bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 200)))
    else:
        for _ in range(rnd.randrange(2, 10)):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
    return b


def corrupt(args):
    eng = ds4.ReferenceEngine()
    base = tempfile.mkdtemp(prefix="ds4-corrupt-")
    src = os.path.join(base, "src")
    texts = [f"corruption campaign conversation {k}. " * (8 + 4 * k) for k in range(4)]
    st = ds4.KVStore(src, min_tokens=8)
    for t in texts:
        s = ds4.Session(eng, ctx=4096)
        s.sync(eng.tokenize(t, special=True))
        st.store_live_prefix(s)
    files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".kv"))
    blobs = [Path(f).read_bytes() for f in files]
    cks = [ds4.open_checkpoint(f) for f in files]
    real = [({k: np.array(v) for k, v in ck.arrays().items()}, ck.tokens, ck.abi, ck.ctx) for ck in cks]
    del cks
    cold = {}
    rnd = random.Random(args.seed)
    stats = {"trials": 0, "crafted": 0, "served_exact": 0, "rejected": {}, "failures": []}
    t_end = time.time() + args.seconds
    while time.time() < t_end:
        i = rnd.randrange(len(files))
        b = bytearray(blobs[i])
        kind = rnd.choice(DAMAGE + CRAFTED)
        if kind in CRAFTED:
            arrays, n_tok, abi, ctx = real[i]
            other = real[(i + 1 + rnd.randrange(len(real) - 1)) % len(real)][0]["tokens"]
            lie, n_hdr = _craft(kind, rnd, arrays, n_tok, other, eng.vocab_size)
            text_b = ds4.open_checkpoint(files[i], load_payload=False).text
            scratch = os.path.join(base, "craft.kv")
            ds4.write_checkpoint(scratch, text_b, lie, abi=abi, tokens=n_hdr, ctx=ctx)
            b = bytearray(Path(scratch).read_bytes())
            stats["crafted"] += 1
        else:
            b = _damage(kind, rnd, b, blobs)
        d = os.path.join(base, "t")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        with open(os.path.join(d, os.path.basename(files[i])), "wb") as f:
            f.write(b)
        text = texts[[ds4._core.sha1_hex(t.encode()) for t in texts].index(os.path.basename(files[i])[:40])]
        s = ds4.Session(eng, ctx=4096)
        stats["trials"] += 1
        try:
            rep = ds4.recover(s, ds4.KVStore(d, min_tokens=8), text + " next")
        except BaseException as e:
            stats["failures"].append(f"{kind}: {type(e).__name__}: {e}")
            continue
        toks, logits = _cold(eng, text + " next", cold)
        if s.tokens != toks or not np.array_equal(s.logits, logits):
            stats["failures"].append(f"{kind}: WRONG state after rung {rep.rung}")
        elif rep.rung == "disk":
            stats["served_exact"] += 1
        elif kind in CRAFTED and rep.rung == "disk":
            stats["failures"].append(f"{kind}: a crafted lie was served")
        for _p, _s, code, _r in rep.rejected:
            stats["rejected"][code] = stats["rejected"].get(code, 0) + 1
            if code == "import_failed":
                stats["failures"].append(f"{kind}: untyped error while importing: {_r}")
    shutil.rmtree(base, ignore_errors=True)
    return stats


def main():
    import logging

    logging.getLogger("ds4").setLevel(logging.ERROR)  # the campaign counts rejections itself
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("crash")
    c.add_argument("--trials", type=int, default=200)
    c = sub.add_parser("concurrency")
    c.add_argument("--procs", type=int, default=4)
    c.add_argument("--ops", type=int, default=500)
    c = sub.add_parser("corrupt")
    c.add_argument("--seconds", type=float, default=600)
    c.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    out = {"crash": crash, "concurrency": concurrency, "corrupt": corrupt}[a.cmd](a)
    print(json.dumps(out, indent=2))
    ok = not (
        out.get("bad")
        or out.get("problems")
        or out.get("failures")
        or out.get("files_failing_verification")
        or out.get("temp_files")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
