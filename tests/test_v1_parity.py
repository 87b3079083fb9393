"""Issue 13, item 7: ds4's own v1 files handled as ds4 handles them.

The files are made byte for byte as ds4's writer makes them
(``ds4_kvstore.c``: 48-byte header, u32 text length, text, DSV4 payload,
trailer room), then judged with ds4's own reader's rules: bytes after the
payload are trailer room (ext bit or not), quantization 2 or 4 and at least
one token (else ds4 ignores the file, and keeps it), names in either case.
A file ds4 would load is never deleted; a fresh temp file of a foreign
writer is judged by its age, not by whether its pid is alive here. A store
evicts to its budget when it opens, and stores the cold checkpoint at the
chat anchor, as ds4 does.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest
from helpers.procs import dead_pid, ds4_json
from test_core_v1 import TEXT, v1_file

import ds4
from ds4 import errors as E
from ds4.checkpoint import open_checkpoint
from ds4.kvstore import KVStore, chat_anchor


def put(d, data: bytes, *, upper: bool = False) -> str:
    name = hashlib.sha1(TEXT).hexdigest()
    path = os.path.join(d, (name.upper() if upper else name) + ".kv")
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_trailer_room_without_the_ext_bit_loads_and_is_never_deleted(tmp_path):
    """ds4 reads a file at least as long as its parts: bytes beyond them
    (room its writer leaves for a trailer) do not make it corrupt."""
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    p = put(d, v1_file(TEXT, ext=0, trailer=bytes(64)))
    ck = open_checkpoint(p, prompt=TEXT + b" and more")
    assert (ck.version, ck.flags, ck.trailer_bytes) == (1, 0, 64)
    assert ck.dsv4 is not None and ck.dsv4["tokens"] == ck.tokens
    st = KVStore(d, min_tokens=1)
    assert [e.path for e in st.entries()] == [p]
    out = ds4_json("kv", "gc", d, check=(0, 1))[0]
    assert out["removed_corrupt"] == [] and os.path.exists(p)
    assert ds4_json("kv", "verify", d, check=(0, 1))[0]["ok"] == 1


@pytest.mark.parametrize(
    ("quant", "tokens", "why"), [(3, 100, "neither 2 nor 4"), (0, 100, "neither"), (4, 0, "no tokens")]
)
def test_a_header_ds4_ignores_is_refused_and_kept(tmp_path, quant, tokens, why):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    p = put(d, v1_file(TEXT, quant=quant, tokens=tokens))
    with pytest.raises(E.V1IgnoredError, match=why) as ei:
        open_checkpoint(p)
    assert isinstance(ei.value, E.IncompatibleCheckpointError) and ei.value.stage == "header"
    st = KVStore(d, min_tokens=1)
    assert st.entries() == [] and os.path.exists(p)  # not listed as usable, not deleted
    info = ds4_json("kv", "ls", d, check=(0, 1))[0]
    row = info[0] if isinstance(info, list) else info["files"][0]
    assert row["status"] == "incompatible" and row["error"]["code"] == "v1_ignored"
    assert ds4_json("kv", "gc", d, check=(0, 1))[0]["removed_corrupt"] == [] and os.path.exists(p)


@pytest.mark.parametrize("quant", [2, 4])
def test_quant_2_and_4_with_tokens_are_read(tmp_path, quant):
    p = put(tmp_path, v1_file(TEXT, quant=quant, tokens=1))
    ck = open_checkpoint(p)
    assert (ck.quant_bits, ck.tokens, ck.dsv4["tokens"]) == (quant, 1, 1)


def test_an_upper_case_name_is_a_checkpoint_name(tmp_path):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    p = put(d, v1_file(TEXT), upper=True)
    assert os.path.basename(p)[:40].isupper()
    ck = open_checkpoint(p, prompt=TEXT + b"!")
    assert ck.text == TEXT
    st = KVStore(d, min_tokens=1)
    assert [e.path for e in st.lookup(TEXT + b"!")] == [p]
    assert ds4_json("kv", "gc", d, check=(0, 1))[0]["removed_corrupt"] == [] and os.path.exists(p)


def test_a_fresh_foreign_temp_file_survives_whatever_its_pid(tmp_path):
    """ds4-server's ``<sha>.kv.tmp.<pid>``, written in another container:
    its pid is dead here and alive there. Only its age may condemn it."""
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    sha = hashlib.sha1(TEXT).hexdigest()
    dead = dead_pid()
    fresh = d / f"{sha}.kv.tmp.{dead}"
    fresh.write_bytes(v1_file(TEXT)[:100])  # a save in flight
    old = d / f"{'0' * 40}.kv.tmp.{dead}"
    old.write_bytes(b"x")
    t = time.time() - 2 * 3600
    os.utime(old, (t, t))
    KVStore(d)
    assert fresh.exists() and not old.exists()
    out = ds4_json("kv", "gc", d, check=(0, 1))[0]
    assert fresh.exists() and out["removed_temp"] == []
    out = ds4_json("kv", "gc", d, "--tmp-age", "0", check=(0, 1))[0]  # an explicit age limit still applies
    assert not fresh.exists()


def test_a_store_evicts_to_its_budget_when_it_opens(tmp_path, write_ck):
    import numpy as np

    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    blob = np.zeros(1 << 20, np.uint8)  # 1 MiB each
    for i in range(6):
        write_ck(d, f"checkpoint number {i} " * 4, {"b": blob}, created=1_700_000_000 + i)
    total = sum(os.path.getsize(d / n) for n in os.listdir(d) if n.endswith(".kv"))
    assert total > 6 << 20
    st = KVStore(d, budget_mb=2.5)
    left = sum(os.path.getsize(d / n) for n in os.listdir(d) if n.endswith(".kv"))
    assert left <= st.budget_bytes and st.stats["evictions"] >= 3
    assert st.total_bytes() == left
    # a scan-less store (the CLI's) changes nothing when it opens
    KVStore(d, budget_mb=0.5, scan=False)
    assert sum(os.path.getsize(d / n) for n in os.listdir(d) if n.endswith(".kv")) == left


def test_a_store_that_cannot_evict_on_open_still_opens(tmp_path, write_ck, caplog):
    """Over budget but unable to take the directory's lock (here a symlinked
    lock file, refused): the store opens for reading all the same."""
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    p = write_ck(d, "a checkpoint over a tiny budget " * 4)
    os.symlink(tmp_path / "elsewhere", d / ".ds4.lock")
    with caplog.at_level("WARNING", logger="ds4.kvstore"):
        st = KVStore(d, budget_mb=1e-6)
    assert [e.path for e in st.entries()] == [p] and os.path.exists(p)
    assert "cannot evict on open" in caplog.text


# -- the chat anchor ---------------------------------------------------------


def _chat(eng, system, users):
    msgs = [{"role": "system", "content": system}]
    for i, u in enumerate(users):
        msgs.append({"role": "user", "content": u})
        if i < len(users) - 1:
            msgs.append({"role": "assistant", "content": f"answer {i}"})
    return eng.render_chat(msgs)


def test_chat_anchor_is_the_last_user_marker_before_the_first_assistant(eng):
    system = "You are a careful assistant. " * 8
    one = _chat(eng, system, ["first question"])
    toks = eng.tokenize(one, special=True)
    a = chat_anchor(toks, eng.token_bytes)
    head = b"".join(eng.token_bytes(t) for t in toks[:a])
    assert head.endswith(b"<|im_end|>\n") and b"<|im_start|>user" not in head
    assert one.encode().startswith(head) and one.encode()[len(head) :].startswith(b"<|im_start|>user")
    # two user turns before any assistant: the anchor is at the second
    two = eng.render_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    )
    t2 = eng.tokenize(two, special=True)
    h2 = b"".join(eng.token_bytes(t) for t in t2[: chat_anchor(t2, eng.token_bytes)])
    assert h2.count(b"<|im_start|>user") == 1
    # a later conversation: the anchor stays before the first assistant turn
    later = _chat(eng, system, ["first question", "second question"])
    tl = eng.tokenize(later, special=True)
    assert chat_anchor(tl, eng.token_bytes) == a
    # no user marker, or one at position 0: no anchor
    assert chat_anchor(eng.tokenize("plain text", special=True), eng.token_bytes) is None
    u0 = eng.tokenize(eng.render_chat([{"role": "user", "content": "x"}]), special=True)
    assert chat_anchor(u0, eng.token_bytes) is None


def test_the_cold_checkpoint_is_stored_at_the_chat_anchor(eng, tmp_path):
    """The system prompt is the conversation's shared head: a prefill stores
    it, so the next conversation with the same system prompt loads it."""
    system = "You are a careful assistant who answers in full sentences. " * 4
    store = KVStore(tmp_path, min_tokens=16)
    s = ds4.Session(eng, ctx=2048)
    prompt = _chat(eng, system, ["what is the first question?"])
    rep = ds4.recover(s, store, prompt, cold_save=True)
    assert rep.rung == "prefill" and rep.cold_saved
    head = eng.render_chat([{"role": "system", "content": system}], add_generation_prompt=False).encode()
    assert open_checkpoint(rep.cold_saved).text == head
    # another user question under the same system prompt starts from it
    s2 = ds4.Session(eng, ctx=2048)
    rep2 = ds4.recover(s2, store, _chat(eng, system, ["something else entirely"]))
    assert rep2.rung == "disk" and rep2.loaded_path == rep.cold_saved
    # an anchor shorter than min_tokens: ds4's trimmed, aligned length instead
    small = KVStore(tmp_path / "small", min_tokens=len(eng.tokenize(head.decode(), special=True)) + 1)
    toks = eng.tokenize(prompt, special=True)
    assert small.policy.cold_store_at(toks, eng.token_bytes) == small.policy.cold_store_len(len(toks))
