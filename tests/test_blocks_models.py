"""Shared blocks on real models through llama.cpp (SmolLM2, Gemma 3: a
plain and a sliding-window KV cache): a conversation saved at each of 10
turns, its last manifest loaded in a new process, equals a cold prefill
there (greedy tokens and logits); two conversations under one 2,000-token
system prompt store its blocks once and each resumes exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.models import engine

import ds4
from ds4.blocks import block_tokens_for
from ds4.keytext import tokenize_prompt
from ds4.kvstore.blocks import BLOCKS_DIR

CTX = 8192

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from helpers.models import engine
    import ds4
    eng = engine({model!r})
    given = json.loads(sys.stdin.read())
    refs = np.load(given["cold"]) if given["cold"] else None
    out = []
    for i, prompt in enumerate(given["prompts"]):
        store = ds4.KVStore({dir!r}, min_tokens=64, blocks=True, block_tokens={block})
        s = ds4.Session(eng, ctx={ctx})
        rep = ds4.recover(s, store, prompt, evict_save=False)
        if refs is None:
            cold = ds4.Session(eng, ctx={ctx})
            ds4.recover(cold, None, prompt)
            tokens, logits, greedy = cold.tokens, cold.logits, cold.generate(12)
        else:  # the cold prefill the test made of the prompt (the same engine)
            tokens, logits, greedy = refs[f"tokens{{i}}"].tolist(), refs[f"logits{{i}}"], refs[f"greedy{{i}}"].tolist()
        out.append(dict(
            rung=rep.rung, reused=rep.reused_tokens, rejected=[r.code for r in rep.rejected],
            same_tokens=s.tokens == tokens, same_logits=bool(np.array_equal(s.logits, logits)),
            same_greedy=s.generate(12) == greedy,
        ))
    print(json.dumps(out))
    """
)


def _in_new_process(model: str, store_dir: str, prompts: list[str], block: int, cold: str | None = None) -> list[dict]:
    """Each prompt loaded from ``store_dir`` in a new process, compared there
    with a cold prefill of it: the child's own, or the one the test made
    (``cold``: an ``.npz`` of ``tokens<i>``, ``logits<i>`` and ``greedy<i>``
    (12 tokens) of prompt ``i``, as :func:`_save_cold` writes it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = _CHILD.format(tests=here, model=model, dir=store_dir, block=block, ctx=CTX)
    given = json.dumps({"prompts": prompts, "cold": cold})
    run = subprocess.run([sys.executable, "-c", code], input=given, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _save_cold(path: str, colds: list[tuple[list[int], np.ndarray, list[int]]]) -> str:
    """Write the cold prefills ``(tokens, logits, 12 greedy tokens)`` of
    prompts ``0, 1, ...`` for :func:`_in_new_process`; returns ``path``."""
    arrays = {}
    for i, (tokens, logits, greedy) in enumerate(colds):
        arrays.update({f"tokens{i}": np.array(tokens), f"logits{i}": logits, f"greedy{i}": np.array(greedy)})
    np.savez(path, **arrays)
    return path


def _chat(eng, system: str, turns: list[str]) -> list[str]:
    """The rendered prompt after each user turn (each reply a fixed line)."""
    msgs = [{"role": "system", "content": system}]
    out = []
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        out.append(eng.render_chat(msgs))
        msgs.append({"role": "assistant", "content": f"Noted, step {i} is recorded."})
    return out


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _unique_bytes(store_dir: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(store_dir):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith((".kv", ".kvb")))
    return total


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_saved_each_turn_then_loaded_in_a_new_process_equals_cold(model, tmp_path):
    eng = engine(model)
    d = str(tmp_path / "kv")
    store = ds4.KVStore(d, min_tokens=64, blocks=True, block_tokens=64)
    turns = [
        f"Step {i}: the build of module {i} " + "printed a warning about unused imports; " * (3 + i) for i in range(10)
    ]
    prompts = _chat(eng, "You are a careful build assistant. " * 8, turns)
    sess = ds4.Session(eng, ctx=CTX)
    for p in prompts:
        ds4.recover(sess, None, p)
        assert isinstance(store.store_live_checked(sess, "continued"), str)
    n = sess.n_past
    blocks_dir = os.path.join(d, BLOCKS_DIR)
    files = [f for f in os.listdir(blocks_dir) if f.endswith(".kvb")]  # temp files beside them
    # every block of the last state, each written once over the 10 saves
    assert len(files) == store.blocks.counts["written"] == n // block_tokens_for(eng, 64)
    assert store.blocks.counts["bytes_written"] == sum(os.path.getsize(os.path.join(blocks_dir, f)) for f in files)
    (got,) = _in_new_process(model, d, [prompts[-1] + " And one more thing."], 64)
    assert got["rung"] == "disk" and got["reused"] == n and not got["rejected"], got
    assert got["same_tokens"] and got["same_logits"] and got["same_greedy"], got


def test_two_conversations_share_a_2000_token_system_prompt(tmp_path):
    eng = engine("smollm2")
    system = "".join(
        f"Rule {i}: keep the answer to the point and cite the file {i}.py when it matters. " for i in range(110)
    )
    sys_tokens = len(tokenize_prompt(eng, eng.render_chat([{"role": "system", "content": system}])))
    assert sys_tokens >= 2000
    d_blocks, d_one = str(tmp_path / "blocks"), str(tmp_path / "one")
    store = ds4.KVStore(d_blocks, min_tokens=64, blocks=True, block_tokens=64)
    only_a = ds4.KVStore(d_one, min_tokens=64, blocks=True, block_tokens=64)
    prompts, ids, colds = [], [], []
    for k, targets in ((0, [store, only_a]), (1, [store])):
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Agent {k}: list the rules about tests."},
        ]
        prompts.append(eng.render_chat(msgs))
        s = ds4.Session(eng, ctx=CTX)
        ds4.recover(s, None, prompts[-1])
        ids.append(s.tokens)
        for target in targets:
            assert isinstance(target.store_live_checked(s, "cold"), str)
        # a cold prefill of the prompt (a new session, no store): what the new
        # process's load must equal (it makes none of its own)
        colds.append((s.tokens, np.array(s.logits), s.generate(12)))
    common = _common(*ids) // 64
    assert common >= 2000 // 64
    # the second conversation wrote only the blocks past the shared prefix
    assert store.blocks.counts["written"] == len(ids[0]) // 64 + len(ids[1]) // 64 - common
    assert store.blocks.counts["present"] == common
    one, both = _unique_bytes(d_one), _unique_bytes(d_blocks)
    own = both - one  # the second conversation's manifest and its own blocks
    assert own < 0.25 * one, (one, both)
    cold = _save_cold(str(tmp_path / "cold.npz"), colds)
    for got in _in_new_process("smollm2", d_blocks, prompts, 64, cold):
        assert got["rung"] == "disk" and not got["rejected"], got
        assert got["same_tokens"] and got["same_logits"] and got["same_greedy"], got
