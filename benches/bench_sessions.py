"""Session benchmarks (issue #3, item 8): every figure is a ratio against a
baseline timed in the same run (these machines are shared and noisy).

1. Time to first token, resumed from a disk checkpoint vs a cold prefill,
   for 1k/4k/16k-token prompts on the reference engine and a 2k-token prompt
   on SmolLM2 (llama.cpp). The checkpoint holds the conversation up to the
   last turn; the new turn (~3% of the prompt) is prefilled. Target:
   resumed <= 10% of cold.
   With ``--split``: SmolLM2 at about 1,000 tokens, the resumed time split
   into its parts (issue 12): store open (a fresh KVStore, from its index
   file), lookup, verify (the whole pipeline, checksum included), load
   (into a Session whose engine kept its llama context), suffix prefill,
   first token; the ratio is the ladder's own path (KVStore + recover +
   argmax) against a cold prefill, both on a kept context. Target <= 3%.
2. Checkpoint save and load on SmolLM2's state vs llama-cpp-python's own
   `Llama.save_state`/`load_state` and its `LlamaDiskCache` on the same
   state. Target: ds4 load (with verification) >= 5x faster than load_state.

    python benches/bench_sessions.py [--quick] [--skip-llama] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import ds4


def med(f, n, setup=None):
    """Median seconds of ``f`` over ``n`` runs; ``setup`` runs untimed before each."""
    ts = []
    for _ in range(n):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def chat_prompt(engine, n_tokens):
    """A chat whose rendering has about n_tokens tokens; returns (history
    prompt, history + next turn prompt)."""
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    i = 0
    while True:
        msgs.append(
            {"role": "user", "content": f"Turn {i}: tell me something about topic number {i}, please, in detail."}
        )
        msgs.append({"role": "assistant", "content": f"Topic {i} is a fine topic. " * 6})
        i += 1
        hist = engine.render_chat(msgs, add_generation_prompt=False)
        if len(engine.tokenize(hist, special=True)) >= int(n_tokens * 0.97):
            break
    nxt = engine.render_chat(
        [*msgs, {"role": "user", "content": "And finally, summarise all the topics we covered so far in a few words."}]
    )
    return hist, nxt


def ttft(engine, n_tokens, repeats, ctx):
    hist, nxt = chat_prompt(engine, n_tokens)
    d = tempfile.mkdtemp(prefix="ds4-bench-")
    try:
        store = ds4.KVStore(d, budget_mb=8192, min_tokens=16)
        s = ds4.Session(engine, ctx=ctx)
        s.sync(engine.tokenize(hist, special=True))
        store.store_live_prefix(s, "continued")
        full = engine.tokenize(nxt, special=True)

        def cold():
            c = ds4.Session(engine, ctx=ctx)
            c.sync(full)
            c.argmax()

        def resumed():
            r = ds4.Session(engine, ctx=ctx)
            rep = ds4.recover(r, ds4.KVStore(d, budget_mb=8192, min_tokens=16), nxt)
            assert rep.rung == "disk", rep.as_dict()
            r.argmax()

        # alternate to spread machine noise over both
        tc, tr = [], []
        for _ in range(repeats):
            tc.append(med(cold, 1))
            tr.append(med(resumed, 1))
        return len(full), statistics.median(tc), statistics.median(tr)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def ttft_split(engine, n_tokens, repeats, ctx):
    """Resumed vs cold time to first token, both on a Session whose engine
    kept its context (as the server's one Session does), and the resumed
    time in parts."""
    hist, nxt = chat_prompt(engine, n_tokens)
    d = tempfile.mkdtemp(prefix="ds4-bench-")
    kw = {"budget_mb": 8192, "min_tokens": 16}
    try:
        s = ds4.Session(engine, ctx=ctx)
        s.sync(engine.tokenize(hist, special=True))
        path = ds4.KVStore(d, **kw).store_live_prefix(s, "continued")
        abi, n_hist = s.payload_abi, s.n_past
        del s  # its context is kept by the engine
        full = engine.tokenize(nxt, special=True)
        pb = nxt.encode("utf-8")
        quant = getattr(engine, "quant_bits", 0)

        def cold():
            c = ds4.Session(engine, ctx=ctx)
            c.sync(full)
            c.argmax()

        def resumed():
            r = ds4.Session(engine, ctx=ctx)
            rep = ds4.recover(r, ds4.KVStore(d, **kw), nxt)
            assert rep.rung == "disk", rep.as_dict()
            r.argmax()

        def parts():
            t = [time.perf_counter()]
            st = ds4.KVStore(d, **kw)
            t.append(time.perf_counter())
            found = st.candidates(pb, ctx=ctx)
            assert found.entries and found.entries[0].path == path
            t.append(time.perf_counter())
            r = ds4.Session(engine, ctx=ctx)
            t.append(time.perf_counter())
            ck = ds4.open_checkpoint(path, prompt=pb, expected_abi=abi, quant_bits=quant, ctx=ctx - 1)
            t.append(time.perf_counter())
            r.load_checkpoint(ck)
            t.append(time.perf_counter())
            r.sync(full)
            t.append(time.perf_counter())
            r.argmax()
            t.append(time.perf_counter())
            names = ("open", "lookup", "session", "verify", "load", "suffix_prefill", "first_token")
            return {k: b - a for k, a, b in zip(names, t[:-1], t[1:], strict=True)}

        tc, tr, split = [], [], []
        cold()
        resumed()
        for _ in range(repeats):  # alternated, so drift hits all three
            tc.append(med(cold, 1))
            tr.append(med(resumed, 1))
            split.append(parts())
        fresh = []  # what the kept context saves: creating one (llama_init_from_model)
        from ds4.engines.llamacpp import LlamaCppContext

        for _ in range(3):
            t0 = time.perf_counter()
            c = LlamaCppContext(engine, ctx)  # bypasses the kept context
            fresh.append(time.perf_counter() - t0)
            c.close()
        return {
            "context_creation_s": statistics.median(fresh),
            "tokens": len(full),
            "stored_tokens": n_hist,
            "cold_s": statistics.median(tc),
            "resumed_s": statistics.median(tr),
            "ratio": statistics.median(tr) / statistics.median(tc),
            "split_s": {k: statistics.median(p[k] for p in split) for k in split[0]},
            "contexts_reused": getattr(engine, "contexts_reused", None),
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


def llama_save_load(engine, repeats):
    """ds4 checkpoint save/load vs llama-cpp-python's save_state/load_state
    and LlamaDiskCache, on the same SmolLM2 state (2k tokens)."""
    import llama_cpp

    hist, _ = chat_prompt(engine, 2048)
    toks = engine.tokenize(hist, special=True)
    d = tempfile.mkdtemp(prefix="ds4-bench-")
    try:
        # ds4
        store = ds4.KVStore(d, budget_mb=8192, min_tokens=16)
        s = ds4.Session(engine, ctx=4096)
        s.sync(toks)
        path = None

        def save_ds4():
            nonlocal path
            if path and os.path.exists(path):
                os.unlink(path)
                store.refresh(force=True)
            path = store.store_live_prefix(s, "continued")

        t_save = med(save_ds4, repeats)
        size = os.path.getsize(path)
        text = s.text_bytes()

        target = ds4.Session(engine, ctx=4096)  # an existing session, as load_state has an existing context

        leased = []

        def load_ds4():
            # verification on, checksum incl.; the payload mapped under a read lease
            ck = ds4.open_checkpoint(path, prompt=text, expected_abi=s.payload_abi)
            leased.append(ck.leased)
            target.load_checkpoint(ck)

        t_load = med(load_ds4, repeats)

        def load_ds4_copy():
            # the other way to load only verified bytes: copy, checksumming the copy
            ck = ds4.open_checkpoint(path, prompt=text, expected_abi=s.payload_abi, mmap=False)
            target.load_checkpoint(ck)

        t_load_copy = med(load_ds4_copy, repeats)

        # llama-cpp-python's own API on the same model and tokens
        llm = llama_cpp.Llama(model_path=engine.model_path, n_ctx=4096, n_batch=512, verbose=False, logits_all=False)
        llm.eval(toks)
        st_holder = {}

        def save_lcp():
            st_holder["s"] = llm.save_state()

        t_lsave = med(save_lcp, repeats)
        state = st_holder["s"]

        def load_lcp():
            llm.load_state(state)

        t_lload = med(load_lcp, repeats)

        cache = llama_cpp.LlamaDiskCache(cache_dir=os.path.join(d, "lcp-disk"))
        key = tuple(toks)

        quiet = contextlib.redirect_stderr(io.StringIO())  # LlamaDiskCache prints on every set

        def save_disk():
            with quiet:
                cache[key] = state

        t_dsave = med(save_disk, repeats)

        def load_disk():
            with quiet:
                st = cache[key]  # LlamaDiskCache pops the entry on read
            llm.load_state(st)

        def put_back():
            with quiet:
                cache[key] = state

        # the get and the load alone: the entry the get popped is put back
        # between repeats, untimed (its write is a save, not part of a load)
        t_dload = med(load_disk, repeats, setup=put_back)
        return {
            "tokens": len(toks),
            "ds4_file_mib": size / 2**20,
            "ds4_save_s": t_save,
            "ds4_load_verify_s": t_load,
            "ds4_load_leased": all(leased),
            "ds4_load_copy_s": t_load_copy,
            "llama_save_state_s": t_lsave,
            "llama_load_state_s": t_lload,
            "llama_disk_cache_save_s": t_dsave,
            "llama_disk_cache_load_s": t_dload,
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--split", action="store_true", help="only the SmolLM2 ~1,000-token resumed/cold split")
    ap.add_argument("--json")
    ap.add_argument("--save-load-only", action="store_true", help="only SmolLM2's save/load comparison")
    a = ap.parse_args()
    out = split(a) if a.split else whole(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


def split(a: argparse.Namespace) -> dict:
    """SmolLM2's resumed time to first token, in parts."""
    r = ttft_split(ds4.LlamaCppEngine(), 1000, 3 if a.quick else 7, ctx=2048)
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["split_s"].items())
    print(
        f"smollm2 {r['tokens']} tokens ({r['stored_tokens']} stored): cold {r['cold_s'] * 1e3:.1f} ms, "
        f"resumed {r['resumed_s'] * 1e3:.1f} ms = {r['ratio']:.2%} of cold (target <= 3%)\n  resumed split: {parts}"
        f"\n  a new llama context (what the kept one saves): {r['context_creation_s'] * 1e3:.1f} ms"
    )
    return r


def whole(a: argparse.Namespace) -> dict:
    """Resumed vs cold on both engines, and SmolLM2's save and load."""
    reps = 2 if a.quick else 5
    out = {"ttft": [], "save_load": None}
    ref = ds4.ReferenceEngine()
    sizes = [1024, 4096] if a.quick else [1024, 4096, 16384]
    print(f"{'engine':<10} {'prompt':>7} {'cold s':>8} {'resumed s':>10} {'resumed/cold':>13}")
    for n in [] if a.save_load_only else sizes:
        nt, c, r = ttft(ref, n, 1 if n > 8000 else reps, ctx=20000)
        out["ttft"].append({"engine": "reference", "tokens": nt, "cold_s": c, "resumed_s": r, "ratio": r / c})
        print(f"{'reference':<10} {nt:>7} {c:>8.3f} {r:>10.3f} {r / c:>12.1%}")
        sys.stdout.flush()
    if not a.skip_llama:
        lc = ds4.LlamaCppEngine()
        if not a.save_load_only:
            nt, c, r = ttft(lc, 2048, reps, ctx=4096)
            out["ttft"].append({"engine": "smollm2", "tokens": nt, "cold_s": c, "resumed_s": r, "ratio": r / c})
            print(f"{'smollm2':<10} {nt:>7} {c:>8.3f} {r:>10.3f} {r / c:>12.1%}")
        sl = llama_save_load(lc, reps)
        out["save_load"] = sl
        print(f"\nSmolLM2 state, {sl['tokens']} tokens, ds4 file {sl['ds4_file_mib']:.1f} MiB")
        print(
            f"  save: ds4 {sl['ds4_save_s'] * 1e3:.1f} ms (durable), Llama.save_state {sl['llama_save_state_s'] * 1e3:.1f} ms (memory), "
            f"LlamaDiskCache {sl['llama_disk_cache_save_s'] * 1e3:.1f} ms"
        )
        print(
            f"  load: ds4 {sl['ds4_load_verify_s'] * 1e3:.1f} ms (verified, leased map: {sl['ds4_load_leased']}), "
            f"ds4 copy {sl['ds4_load_copy_s'] * 1e3:.1f} ms (verified copy), "
            f"Llama.load_state {sl['llama_load_state_s'] * 1e3:.1f} ms, "
            f"LlamaDiskCache {sl['llama_disk_cache_load_s'] * 1e3:.1f} ms"
        )
        print(
            f"  load_state / ds4 load = {sl['llama_load_state_s'] / sl['ds4_load_verify_s']:.1f}x; "
            f"load_state / ds4 copy load = {sl['llama_load_state_s'] / sl['ds4_load_copy_s']:.1f}x; "
            f"LlamaDiskCache load / ds4 load = {sl['llama_disk_cache_load_s'] / sl['ds4_load_verify_s']:.1f}x"
        )
    return out


if __name__ == "__main__":
    main()
