"""``ds4.loading``'s remote rung on its own (``try_load_text``,
``load_first``, ``_load_remote``) against a real ``redis-server``: what the
ladder's tests reach only through ``recover`` (issue 24: ten mutants of the
remote rung alive after the mutation run over the invalidation sites).

- a single rung asks the tier with the session's payload ABI and loads the
  tier's longer prefix (``tier == "remote"``, the tier's hit counted);
- a download that verifies but that the session refuses is the store's
  to discard, reported, the session invalidated, and the entry deleted from
  the tier (``not_loaded``);
- the download is verified against the prompt's bytes, not only its SHA-1:
  a colliding text (SHAttered) is rejected before it reaches the directory
  or the session.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from helpers.kv import prefilled
from test_kvstore import SHATTERED_1, SHATTERED_2

import ds4
from ds4.checkpoint import write_checkpoint
from ds4.kvstore import KVStore, checkpoint_name
from ds4.kvstore.remote import KeyLayout, RemoteTier
from ds4.loading import try_load_text
from ds4.recovery import RecoveryReport

CHUNK = 64 * 1024
MIN_TOKENS = 32
CTX = 2048


@pytest.fixture
def stores(node, tmp_path):
    """``stores(name) -> KVStore`` over ``tmp_path/name``, all on one flushed tier."""
    with node.client() as c:
        c.flushall()
    made = []

    def make(name):
        st = KVStore(tmp_path / name, remote=RemoteTier(node.url, chunk_bytes=CHUNK), min_tokens=MIN_TOKENS)
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()


def _prompt(topic, n=40):
    return " ".join(f"{topic}-{i}" for i in range(n)) + " end."


def _live(eng):
    s = ds4.Session(eng, ctx=CTX)
    s.sync(eng.tokenize("a live conversation of its own", special=True))
    assert s.checkpoint_valid
    return s


def _held(st, sha):
    """What the tier holds of ``sha`` (manifest, chunks, index member)."""
    abi = ds4.ReferenceEngine().payload_abi()
    keys = KeyLayout("shared", abi)
    c = st.remote.client()
    tagged = [k.decode() for k in c.keys(keys.tag(sha).replace("{", "\\{").replace("}", "\\}") + "*")]
    return tagged + [m.decode() for m in c.zrange(keys.index, 0, -1) if m.decode().endswith(sha)]


def test_one_rung_loads_the_tiers_longer_prefix(eng, stores):
    a, b = stores("a"), stores("b")
    prompt = _prompt("rung")
    donor = prefilled(eng, prompt, CTX)
    assert a.store_live_prefix(donor, "cold") is not None and a.remote.flush(30)
    short = prefilled(eng, prompt[:200], CTX)
    local = b.store_live_prefix(short, "cold")  # b's own, shorter: the tier's goes first
    assert local is not None and b.remote.flush(30)
    sess, rep = ds4.Session(eng, ctx=CTX), RecoveryReport()
    res = try_load_text(b, sess, prompt + " and a question?", rep)
    assert res is not None and res.tier == "remote"
    assert res.tokens == donor.n_past and res.text_bytes == len(donor.text_bytes())
    assert res.path == os.path.join(b.dir, os.path.basename(res.path)) != local
    assert rep.rejected == []
    assert b.remote.counters["hits"] == 1 and b.stats["hits"] == 1
    assert sess.tokens == donor.tokens and np.array_equal(sess.logits, donor.logits)


def _lying_file(eng, directory, prompt):
    """A checkpoint of ``prompt`` whose payload is another text's state of
    as many tokens: every check of the file passes, the session's (its
    tokens must render its text) does not."""
    other = prefilled(eng, prompt.upper(), CTX)
    text = prefilled(eng, prompt, CTX).text_bytes()
    assert len(other.tokens) == len(text)
    path = os.path.join(os.fspath(directory), hashlib.sha1(text).hexdigest() + ".kv")
    write_checkpoint(path, text, other.export_arrays(), abi=other.payload_abi, tokens=other.n_past, ctx=CTX)
    return path


def test_a_download_the_session_refuses_is_discarded_and_deleted_from_the_tier(eng, stores):
    a, b = stores("a"), stores("b")
    prompt = _prompt("liar")
    path = _lying_file(eng, a.dir, prompt)
    a.refresh(force=True)
    assert a.push() == {"stored": 1}
    sha = os.path.basename(path)[:40]
    assert _held(a, sha)
    sess, rep = _live(eng), RecoveryReport()
    assert try_load_text(b, sess, prompt + "?", rep) is None
    mine = os.path.join(b.dir, checkpoint_name(sha, sess.payload_abi))  # the download's name: its model's
    assert [(p, stage, code) for (p, stage, code, _r) in rep.rejected] == [(mine, "engine", "tokens_text_mismatch")]
    assert not os.path.exists(mine) and b.stats["removed_corrupt"] == 1
    assert not sess.checkpoint_valid and sess.tokens == [] and sess.logits is None
    assert _held(b, sha) == []  # the tier's copy went with it
    assert b.stats["misses"] == 1


def test_a_colliding_download_is_rejected_before_the_directory(eng, stores):
    """SHAttered: two 320-byte texts with one SHA-1. The tier finds the
    stored one for a prompt that starts with the other (its index knows
    only the digest); the download's check of the prompt's bytes rejects it
    (and deletes it from the tier): the directory never holds it, the live
    session is not touched."""
    a, b = stores("a"), stores("b")
    sess = _live(eng)
    tail = b" and the rest"
    text, prompt = SHATTERED_1 + tail, SHATTERED_2 + tail
    assert hashlib.sha1(text).digest() == hashlib.sha1(prompt).digest()
    name = hashlib.sha1(text).hexdigest() + ".kv"
    arrays = {"tokens": np.zeros(len(text), dtype=np.int32), "logits": np.zeros(eng.vocab_size, dtype=np.float32)}
    write_checkpoint(os.path.join(a.dir, name), text, arrays, abi=sess.payload_abi, tokens=len(text), ctx=CTX)
    a.refresh(force=True)
    assert a.push() == {"stored": 1}
    before = list(sess.tokens)
    rep = RecoveryReport()
    assert try_load_text(b, sess, prompt + b"?", rep) is None
    mine = checkpoint_name(name[:40], sess.payload_abi)
    assert [(p, stage, code) for (p, stage, code, _r) in rep.rejected] == [
        (f"remote:{mine}", "text", "prefix_collision")
    ]
    assert not os.path.exists(os.path.join(b.dir, mine))
    assert sess.checkpoint_valid and sess.tokens == before
    assert _held(b, name[:40]) == []


def test_the_adopted_download_is_loaded_against_the_prompt_too(eng, stores, monkeypatch):
    """The file a download became is opened again for the load, against the
    prompt's bytes again: a colliding text put in its place meanwhile (same
    name, same SHA-1) is refused as a collision, not loaded."""
    a, b = stores("a"), stores("b")
    sess = _live(eng)
    tail = b" and the rest"
    honest, twin = SHATTERED_2 + tail, SHATTERED_1 + tail
    name = hashlib.sha1(honest).hexdigest() + ".kv"
    arrays = {"tokens": np.zeros(len(honest), dtype=np.int32), "logits": np.zeros(eng.vocab_size, dtype=np.float32)}
    kw = {"abi": sess.payload_abi, "tokens": len(honest), "ctx": CTX}
    write_checkpoint(os.path.join(a.dir, name), honest, arrays, **kw)
    a.refresh(force=True)
    assert a.push() == {"stored": 1}
    tier = b.shared
    real = tier.fetch

    def twin_after_download(*args):
        e = real(*args)
        assert e is not None  # the honest download verified and was adopted
        write_checkpoint(e.path, twin, arrays, **kw)  # same name: same SHA-1
        return e

    monkeypatch.setattr(tier, "fetch", twin_after_download)
    rep = RecoveryReport()
    assert try_load_text(b, sess, honest + b"?", rep) is None
    mine = os.path.join(b.dir, checkpoint_name(name[:40], sess.payload_abi))
    assert [(p, stage, code) for (p, stage, code, _r) in rep.rejected] == [(mine, "text", "prefix_collision")]
    assert not os.path.exists(mine)
    assert not sess.checkpoint_valid  # a corrupt verdict on a load: the session is not trusted


def test_a_download_that_fails_its_checks_is_deleted_and_the_next_remote_one_tried(eng, stores):
    a, b = stores("a"), stores("b")
    short = _prompt("next")
    long = short + " " + _prompt("next2")
    kept = prefilled(eng, short, CTX)
    for s in (kept, prefilled(eng, long, CTX)):
        assert a.store_live_prefix(s, "cold") is not None
    assert a.remote.flush(30)
    abi = kept.payload_abi
    top, second = sorted(a.remote.entries(abi), key=lambda e: -e.tokens)
    keys = KeyLayout("shared", abi)
    c = a.remote.client()
    v = bytearray(c.get(keys.chunk(top.sha, 0)))
    v[100] ^= 0x10
    c.set(keys.chunk(top.sha, 0), bytes(v))  # its chunk digest no longer matches
    sess, rep = ds4.Session(eng, ctx=CTX), RecoveryReport()
    res = try_load_text(b, sess, long + " question?", rep)
    assert res is not None and res.tier == "remote" and res.tokens == second.tokens == kept.n_past
    assert [(p, code) for (p, _stage, code, _r) in rep.rejected] == [(f"remote:{top.name}", "remote_chunk")]
    assert _held(b, top.sha) == []
    assert sess.tokens == kept.tokens and np.array_equal(sess.logits, kept.logits)
