"""The recovery ladder against every failure kind of docs/DESIGN.md's pipeline table.

For each kind: a damaged long checkpoint sits beside a good shorter one; the
ladder must reject the damaged one (removing it when corrupt, keeping it when
incompatible), serve the shorter one, leave the session valid at exactly the
prompt, and generate the same tokens a cold prefill generates. Runs on the
NumPy reference engine, and on SmolLM2 and Gemma 3 through llama.cpp.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import models

import ds4
from ds4 import _core
from ds4.checkpoint import open_checkpoint, write_checkpoint
from ds4.kvstore import checkpoint_name

GEN = 12


def recover(*a, **kw):
    """The ladder without its prompt checkpoints (Gemma's default): these
    tests count the files a recovery leaves, and a new file for the prompt
    is not what they are about (tests/test_models_rungs.py tests it)."""
    kw.setdefault("prompt_save", False)
    return ds4.recover(*a, **kw)


def _chat(engine, n_turns):
    msgs = [{"role": "system", "content": "You are a careful assistant who answers briefly and precisely."}]
    topics = [
        "the tides",
        "bread baking",
        "prime numbers",
        "the moon",
        "bicycles",
        "rainbows",
        "volcanoes",
        "chess openings",
        "coffee",
        "glaciers",
    ]
    for i in range(n_turns):
        t = topics[i % len(topics)]
        msgs.append(
            {
                "role": "user",
                "content": f"Question {i}: explain {t} in two sentences, then give one surprising fact about {t}.",
            }
        )
        msgs.append(
            {
                "role": "assistant",
                "content": f"Answer {i}: {t} are interesting because of physics and history; one fact is that {t} vary a lot by place.",
            }
        )
    msgs.append({"role": "user", "content": "Now summarise everything we discussed in one sentence."})
    return engine.render_chat(msgs)


class World:
    """Engine, prompt, cold reference output and two good checkpoints."""

    def __init__(self, engine, tmp, short, long, min_prompt):
        self.engine = engine
        self.ctx = 4096
        n = 2
        while True:
            prompt = _chat(engine, n)
            toks = engine.tokenize(prompt, special=True)
            if len(toks) >= min_prompt:
                break
            n += 1
        self.prompt = prompt
        self.tokens = toks
        self.short, self.long = short, long
        cold = ds4.Session(engine, ctx=self.ctx)
        cold.sync(toks)
        # the cold prefill's logits and next token (read-only), kept for the
        # tests that compare a resumed session's with them
        self.cold_logits = np.array(cold.logits)
        self.cold_logits.flags.writeable = False
        self.cold_argmax = cold.argmax()
        self.cold_out = cold.generate(GEN)
        self.template = os.path.join(tmp, "template")
        store = self.store(self.template)
        paths = []
        for n_tok in (short, long):
            s = ds4.Session(engine, ctx=self.ctx)
            s.sync(toks[:n_tok])
            paths.append(store.store_live_prefix(s, "cold"))
        # each under its text's SHA-1 and the engine's model tag
        self.short_path, self.long_path = paths
        assert paths == [
            os.path.join(
                self.template,
                checkpoint_name(_core.sha1_hex(b"".join(engine.token_bytes(t) for t in toks[:n])), s.payload_abi),
            )
            for n in (short, long)
        ]
        assert os.path.exists(self.short_path) and os.path.exists(self.long_path)

    def store(self, d, **kw):
        return ds4.KVStore(d, budget_mb=1024, min_tokens=16, **kw)

    def fresh_dir(self, tmp_path):
        d = str(tmp_path / "cache")
        shutil.copytree(self.template, d)
        return d


@pytest.fixture(scope="module", params=["reference", "llamacpp", "gemma3"])
def world(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp(f"ladder-{request.param}"))
    if request.param == "reference":
        eng = ds4.ReferenceEngine()
        return World(eng, tmp, short=256, long=512, min_prompt=600)
    # SmolLM2 (dense) and Gemma 3 (sliding window; its long checkpoint
    # sits at the 512-token window)
    eng = models.engine("smollm2" if request.param == "llamacpp" else "gemma3")
    return World(eng, tmp, short=256, long=512, min_prompt=600)


def _damaged_bytes(world, kind, scratch):
    """The bytes of the long checkpoint damaged by ``kind``."""
    b = bytearray(Path(world.long_path).read_bytes())
    if kind == "bad_magic":
        b[0] ^= 0x20
    elif kind == "bad_version":
        b[3] = 9
    elif kind == "header_checksum":
        b[8] ^= 0x01  # token count, covered by the header checksum
    elif kind == "text_altered":
        ck = open_checkpoint(world.long_path, load_payload=False)
        b[_find_text(world.long_path, ck.text) + 5] ^= 0x04
    elif kind == "truncated_payload":
        del b[-100:]
    elif kind == "payload_bit":
        b[-200] ^= 0x10
    elif kind == "trailing_bytes":
        b += b"\0" * 64
    elif kind in ("abi", "token_count", "name_mismatch"):
        ck = open_checkpoint(world.long_path)
        arrays = {k: np.array(v) for k, v in ck.arrays().items()}
        text, abi, tokens = ck.text, ck.abi, ck.tokens
        if kind == "abi":
            abi = abi + " variant=other"
        elif kind == "token_count":
            arrays["tokens"] = arrays["tokens"][:-1]
        else:
            # A valid file for other text, under the name of the prompt prefix.
            text = text[:-1] + (b"X" if text[-1:] != b"X" else b"Y")
        os.makedirs(scratch, exist_ok=True)
        out = os.path.join(scratch, os.path.basename(world.long_path))
        write_checkpoint(out, text, arrays, abi=abi, tokens=tokens, ctx=world.ctx)
        b = bytearray(Path(out).read_bytes())
        os.unlink(out)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return bytes(b)


def _damage(world, d, kind, scratch):
    """Replace the long checkpoint in directory ``d`` by a damaged file (a new
    file under the same name); return its path."""
    p = os.path.join(d, os.path.basename(world.long_path))
    data = _damaged_bytes(world, kind, scratch)
    os.unlink(p)
    with open(p, "wb") as f:
        f.write(data)
    return p


def _damage_in_place(world, d, kind, scratch):
    """Damage the long checkpoint in ``d`` in place, as bit rot or another
    process would after this store indexed it: same inode, mtime restored,
    and the directory untouched (no entry added, renamed or removed), so the
    store's index keeps the file as an unchanged candidate. Returns the path
    and whether the file's (inode, size, mtime) stat key is unchanged."""
    p = os.path.join(d, os.path.basename(world.long_path))
    data = _damaged_bytes(world, kind, scratch)
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = os.stat(p)
    return p, (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def _find_text(path, text):
    data = Path(path).read_bytes()
    i = data.find(text)
    assert i > 0
    return i


# kind -> (expected stage, expected code, file kept?)
KINDS = {
    "bad_magic": ("header", "bad_magic", False),
    "bad_version": ("header", "unsupported_version", True),
    "abi": ("header", "abi_mismatch", True),
    "header_checksum": ("header", "header_checksum", False),
    "name_mismatch": ("text", "name_mismatch", False),
    "text_altered": ("text", "text_sha1_mismatch", False),
    "truncated_payload": ("header", "truncated", False),
    "payload_bit": ("payload", "payload_checksum", False),
    "token_count": ("engine", "token_count_mismatch", False),
    "trailing_bytes": ("header", "trailing_bytes", False),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_ladder_rejects_damaged_and_serves_shorter(world, kind, tmp_path, caplog):
    """The damage is there before the store opens the directory: most kinds
    are then found while indexing (the header is read), before the ladder's
    fallback loop; test_ladder_damage_found_at_load covers the loop."""
    d = world.fresh_dir(tmp_path)
    bad = _damage(world, d, kind, str(tmp_path / "scratch"))
    stage, code, kept = KINDS[kind]
    caplog.set_level("INFO", logger="ds4")
    store = world.store(d)
    sess = ds4.Session(world.engine, ctx=world.ctx)
    # A live session on an unrelated conversation, to be replaced.
    sess.sync(world.engine.tokenize("unrelated words " * 4, special=True))
    rep = recover(sess, store, world.prompt, evict_save=False)

    assert rep.rung == "disk", rep.as_dict()
    assert rep.loaded_path == os.path.join(d, os.path.basename(world.short_path))
    assert rep.reused_tokens == world.short
    assert [(s, c) for (_p, s, c, _r) in rep.rejected] == [(stage, code)], rep.rejected
    assert os.path.exists(bad) == kept
    # the good checkpoint is still there and was touched
    assert open_checkpoint(rep.loaded_path).hits == 1
    # the session is valid at exactly the prompt's tokens
    assert sess.checkpoint_valid
    assert sess.tokens == world.tokens
    assert sess.generate(GEN) == world.cold_out
    # every rejection was logged with its stage and code
    assert any(code in r.getMessage() and stage in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


@pytest.mark.parametrize("kind", list(KINDS))
def test_ladder_damage_found_at_load(world, kind, tmp_path, caplog):
    """Every kind reaches the fallback loop of KVStore.try_load_text: the
    store indexes the good files first, then the long one is damaged in
    place, so the index still offers it as the longest candidate and only
    the load can find the damage. The load rejects it (reported with its
    stage and code; corrupt files removed, incompatible ones kept) and the
    ladder falls back to the shorter checkpoint, with cold output.

    Kinds that change the file's size (truncated_payload, trailing_bytes, and
    the rewritten abi/token_count files when their size differs) change its
    stat key: a rescan of the directory would re-read them, and so does the
    stat of each candidate before it is offered (in-place damage leaves the
    directory's mtime alone, which is what gates a rescan). Those whose
    header then says so (truncated_payload, trailing_bytes) are refused
    before the offer, reported in the run's report all the same; so is a
    rewritten abi file (its new ABI is not its per-model name's: kept); the
    rewritten token_count files index fine and reach the loop. Same-size
    kinds keep the whole stat key: they reach the loop."""
    d = world.fresh_dir(tmp_path)
    short = os.path.join(d, os.path.basename(world.short_path))
    long = os.path.join(d, os.path.basename(world.long_path))
    stage, code, kept = KINDS[kind]
    caplog.set_level("INFO", logger="ds4")
    store = world.store(d)
    assert [e.path for e in store.lookup(world.prompt)] == [long, short]
    assert store.stats["scans"] == 1
    dir_mtime = os.stat(d).st_mtime_ns
    bad, same_key = _damage_in_place(world, d, kind, str(tmp_path / "scratch"))
    assert bad == long
    assert os.stat(d).st_mtime_ns == dir_mtime
    if kind in ("truncated_payload", "trailing_bytes"):
        assert not same_key
    elif kind not in ("abi", "token_count"):
        assert same_key, kind
    # another ABI of another length changes the file's size: read again
    # before the offer, its header no longer matches its per-model name
    # (another engine's: kept, never offered)
    kept_at_refresh = kind == "abi" and not same_key
    before_offer = kind in ("truncated_payload", "trailing_bytes") or kept_at_refresh
    if not before_offer:  # the index still offers the damaged file first: the damage is unknown
        assert [e.path for e in store.lookup(world.prompt)] == [bad, short]
    sess = ds4.Session(world.engine, ctx=world.ctx)
    sess.sync(world.engine.tokenize("unrelated words " * 4, special=True))
    rep = recover(sess, store, world.prompt, evict_save=False)

    assert rep.rung == "disk", rep.as_dict()
    assert rep.loaded_path == short
    assert rep.reused_tokens == world.short
    assert [(p, s, c) for (p, s, c, _r) in rep.rejected] == [(bad, stage, code)], rep.rejected
    # reported from the load (or the stat before the offer): the store never
    # rescanned, and only the load loop counts rejections
    assert store.stats["scans"] == 1
    assert store.stats["rejected"] == (0 if before_offer else 1) and store.stats["hits"] == 1
    msgs = [r.getMessage() for r in caplog.records]
    if before_offer:  # read again from its header before the offer, and removed
        end = "(kept)" if kept_at_refresh else "(refresh)"
        assert any(f"code={code}" in m and f"stage={stage}" in m and m.endswith(end) for m in msgs), msgs
    else:
        assert not any("(refresh)" in m for m in msgs), msgs
    if not kept and not before_offer:
        assert any(f"code={code}" in m and f"stage={stage}" in m and m.endswith("(load)") for m in msgs), msgs
    assert os.path.exists(bad) == kept
    assert open_checkpoint(short).hits == 1
    assert sess.checkpoint_valid
    assert sess.tokens == world.tokens
    assert sess.generate(GEN) == world.cold_out


def test_ladder_all_corrupt_falls_back_to_prefill(world, tmp_path):
    d = world.fresh_dir(tmp_path)
    for p in [f for f in os.listdir(d) if f.endswith(".kv")]:
        fp = os.path.join(d, p)
        b = bytearray(Path(fp).read_bytes())
        b[-1] ^= 0xFF
        Path(fp).write_bytes(b)
    store = world.store(d)
    sess = ds4.Session(world.engine, ctx=world.ctx)
    rep = recover(sess, store, world.prompt)
    assert rep.rung == "prefill" and rep.reused_tokens == 0
    assert sorted(c for (_p, _s, c, _r) in rep.rejected) == ["payload_checksum", "payload_checksum"]
    assert [f for f in os.listdir(d) if f.endswith(".kv")] == []
    assert sess.generate(GEN) == world.cold_out


def test_ladder_longest_wins_and_live_rungs(world, tmp_path):
    d = world.fresh_dir(tmp_path)
    store = world.store(d)
    sess = ds4.Session(world.engine, ctx=world.ctx)
    rep = recover(sess, store, world.prompt)
    assert rep.rung == "disk" and rep.reused_tokens == world.long and rep.rejected == []
    assert sess.generate(GEN) == world.cold_out
    # Same prompt again: the live session serves it (token prefix).
    sess2 = ds4.Session(world.engine, ctx=world.ctx)
    recover(sess2, store, world.prompt)
    rep2 = recover(sess2, store, world.prompt)
    assert rep2.rung == "live" and rep2.reused_tokens == len(world.tokens)
    assert sess2.generate(GEN) == world.cold_out


def test_resumed_equals_cold_after_restart(world, tmp_path):
    """A new store object (a restarted process) resumes from disk exactly."""
    d = world.fresh_dir(tmp_path)
    sess = ds4.Session(world.engine, ctx=world.ctx)
    rep = recover(sess, world.store(d), world.prompt)
    assert rep.rung == "disk"
    logits_resumed = np.array(sess.logits)
    # the cold prefill of the same tokens in a new session: the world's
    if isinstance(world.engine, ds4.ReferenceEngine):
        assert np.array_equal(logits_resumed, world.cold_logits)
    assert sess.argmax() == world.cold_argmax


def test_longer_disk_prefix_beats_a_short_rewind(world, tmp_path):
    """The live session shares only a short prefix with the prompt; a rewind
    would keep it, but disk holds a much longer verified prefix: the ladder
    loads from disk (reusing more), and the output still equals cold."""
    d = world.fresh_dir(tmp_path)
    store = world.store(d)
    sess = ds4.Session(world.engine, ctx=world.ctx)
    diverged = world.tokens[:100] + world.engine.tokenize(" a different branch of this conversation", special=False)
    sess.sync(diverged)
    rep = recover(sess, store, world.prompt, evict_save=False)
    assert rep.rung == "disk" and rep.reused_tokens == world.long, rep.as_dict()
    assert any("rewrite skipped" in e for e in rep.events)
    assert sess.generate(GEN) == world.cold_out


def test_rewind_saves_the_discarded_branch_first(world, tmp_path):
    """Interleaved conversations: before the live state is rewound to a shared
    prefix, it is evict-saved, so returning to it later resumes from disk."""
    d = str(tmp_path / "c")
    store = world.store(d)
    eng = world.engine
    sess = ds4.Session(eng, ctx=world.ctx)
    a = world.tokens
    b = world.tokens[:100] + eng.tokenize(" another user's question, quite different", special=False)
    sess.sync(a)
    rep_b = recover(sess, store, eng.detokenize(b))
    assert rep_b.evict_saved is not None  # the A branch went to disk first
    rep_a = recover(sess, store, world.prompt)
    assert rep_a.rung == "disk" and rep_a.reused_tokens == len(a)
    assert sess.generate(GEN) == world.cold_out
