"""The ``ds4`` command through subprocesses: ``run``, ``kv`` on v2 and on
hand-built ds4 v1 directories, ``bench``, and the ``chat`` REPL through a pty."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import time

import numpy as np
import pexpect
import pytest
from helpers.checkpoints import flip_payload_byte
from helpers.procs import dead_pid, ds4_cmd, ds4_json

import ds4
from ds4 import _core
from ds4.checkpoint import open_checkpoint
from ds4.kvstore import checkpoint_name
from ds4.kvstore.files import pid_space

KV = ["--kv-cache-min-tokens", "32", "--kv-cache-boundary-align-tokens", "64"]
PROMPT = (
    "You are reading a long question about harbours, tides, ships and the people who keep lighthouses; "
    "please answer it carefully and in order."
)


# ---------------------------------------------------------------------------
# ds4 run
# ---------------------------------------------------------------------------
def test_run_json_cold_then_from_disk(tmp_path):
    kv = tmp_path / "kv"
    a, _ = ds4_json("run", "-p", PROMPT, "--engine", "reference", "--kv-disk-dir", kv, *KV, "--max-tokens", 12)
    assert set(a) >= {"text", "tokens", "report"}
    assert len(a["tokens"]) == a["usage"]["completion_tokens"] <= 12
    rep = a["report"]
    assert rep["rung"] == "prefill" and rep["reused_tokens"] == 0 and rep["cold_saved"]
    assert rep["save_skipped"] == []  # every save it could make, it made
    assert os.path.exists(rep["cold_saved"])
    n_cold = open_checkpoint(rep["cold_saved"], load_payload=False).tokens
    assert n_cold % 64 == 0 and n_cold <= rep["prompt_tokens"] - 32
    # the same prompt in a new process: served from the cold checkpoint
    b, _ = ds4_json("run", "-p", PROMPT, "--engine", "reference", "--kv-disk-dir", kv, *KV, "--max-tokens", 12)
    assert b["report"]["rung"] == "disk" and b["report"]["reused_tokens"] == n_cold
    assert b["report"]["loaded_path"] == rep["cold_saved"]
    assert (b["text"], b["tokens"]) == (a["text"], a["tokens"])
    # and without a cache directory: the same output, nothing reused
    c, _ = ds4_json("run", "-p", PROMPT, "--engine", "reference", "--max-tokens", 12)
    assert (c["text"], c["tokens"]) == (a["text"], a["tokens"]) and c["report"]["rung"] == "prefill"
    # --raw: no chat template; prompt from stdin; typed failure on overflow
    p = ds4_cmd(
        "run", "-p", "-", "--raw", "--engine", "reference", "--max-tokens", 4, "--json", input="Once upon a time"
    )
    r = json.loads(p.stdout)
    assert r["report"]["prompt_tokens"] == len("Once upon a time")
    p = ds4_cmd("run", "-p", "x" * 300, "--engine", "reference", "--ctx", 128, check=False)
    assert p.returncode == 1 and "does not fit context" in p.stderr
    # seeded sampling is reproducible, and differs from greedy
    s1, _ = ds4_json(
        "run", "-p", PROMPT, "--engine", "reference", "--max-tokens", 12, "--temperature", "1.5", "--seed", 7
    )
    s2, _ = ds4_json(
        "run", "-p", PROMPT, "--engine", "reference", "--max-tokens", 12, "--temperature", "1.5", "--seed", 7
    )
    assert s1["tokens"] == s2["tokens"] != a["tokens"]


def test_run_json_says_why_a_save_did_not_happen(tmp_path):
    """Issue 42: the report of ``ds4 run --json`` lists the saves the turn
    did not make (a prompt under --kv-cache-min-tokens: no cold save)."""
    kv = tmp_path / "kv"
    out, _ = ds4_json(
        "run", "-p", "Once upon a time", "--raw", "--engine", "reference", "--kv-disk-dir", kv,
        "--kv-cache-min-tokens", 64, "--max-tokens", 2,
    )  # fmt: skip
    rep = out["report"]
    n = rep["prompt_tokens"]
    assert rep["cold_saved"] is None and n < 64
    assert rep["save_skipped"] == [{"kind": "cold", "code": "below_min_tokens", "detail": f"{n} tokens < min 64"}]
    assert not [f for f in os.listdir(kv) if f.endswith(".kv")]


def test_run_json_schema(tmp_path):
    """``--json-schema FILE``: the answer is JSON valid under it; a bad or
    missing file is a usage error (exit 2) before any engine is built."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"port": {"type": "string", "maxLength": 6}, "ships": {"type": "integer", "minimum": 0}},
        "required": ["port", "ships"],
        "additionalProperties": False,
    }
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    a, _ = ds4_json("run", "-p", PROMPT, "--engine", "reference", "--max-tokens", 200, "--json-schema", f)
    assert a["finish_reason"] == "stop", a["text"]
    jsonschema.validate(json.loads(a["text"]), schema)
    (tmp_path / "bad.json").write_text('{"type": "no-such-type"}')
    for bad, why in ((tmp_path / "bad.json", "invalid JSON schema"), (tmp_path / "missing.json", "No such file")):
        p = ds4_cmd("run", "-p", PROMPT, "--engine", "reference", "--json-schema", bad, check=False)
        assert p.returncode == 2 and why in p.stderr and not p.stdout, p.stderr


def test_run_progress_bar_only_on_a_tty():
    # The bar appears once a prefill has run for 1 s; DS4_PROGRESS_DELAY=0
    # shows it at once, so a short prefill (a few 256-token chunks) will do.
    long_prompt = "The tide comes in and the tide goes out. " * 40  # ~1600 tokens
    env = dict(os.environ, DS4_PROGRESS_DELAY="0")
    p = subprocess.run(
        [sys.executable, "-m", "ds4", "run", "-p", long_prompt, "--engine", "reference", "--max-tokens", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0 and p.stderr == ""  # stderr is not a TTY: quiet
    c = pexpect.spawn(
        sys.executable,
        ["-m", "ds4", "run", "-p", long_prompt, "--engine", "reference", "--max-tokens", "1"],
        encoding="utf-8",
        codec_errors="replace",
        timeout=60,
        env=env,
    )
    try:
        c.expect(r"prefill \[#*\.*\] (\d+)/(\d+) tok")
        assert 0 < int(c.match.group(1)) <= int(c.match.group(2))
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0


# ---------------------------------------------------------------------------
# ds4 kv on a v2 directory
# ---------------------------------------------------------------------------
def _v2_dir(tmp_path):
    """Three checkpoints of one conversation (cold, continued, evict: an
    explicit one, so the continued snapshot it extends is not superseded)."""
    d = tmp_path / "v2"
    eng = ds4.ReferenceEngine()
    store = ds4.KVStore(d, min_tokens=16)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    toks = eng.tokenize(eng.render_chat(msgs), special=True)
    paths = []
    for n in (64, 128, len(toks)):
        s = ds4.Session(eng, ctx=1024)
        s.sync(toks[:n])
        paths.append(store.store_live_prefix(s, {64: "cold", 128: "continued"}.get(n, "evict")))
    return str(d), paths


def test_kv_commands_on_a_v2_directory(tmp_path):
    d, paths = _v2_dir(tmp_path)
    names = [os.path.basename(p) for p in paths]
    # ls
    out = ds4_cmd("kv", "ls", d).stdout
    for n in names:
        assert n[:12] in out
    assert "3 files" in out and "v2" in out
    ls, _ = ds4_json("kv", "ls", d)
    assert sorted(f["name"] for f in ls["files"]) == sorted(names)
    # headers only: never "ok", which is what a load decides
    assert all(f["status"] == "unverified" and not f["verified"] and f["version"] == 2 for f in ls["files"])
    ls, _ = ds4_json("kv", "ls", d, "--verify")
    assert all(f["status"] == "ok" and f["verified"] for f in ls["files"])
    assert {f["tokens"] for f in ls["files"]} >= {64, 128}
    # show by unique prefix
    show, _ = ds4_json("kv", "show", d, names[1][:10])
    assert show["name"] == names[1] and show["tokens"] == 128 and show["reason"] == "continued"
    assert {t["name"] for t in show["tensors"]} >= {"tokens", "logits", "layer0.k"}
    assert show["text"].startswith("<|im_start|>system\nBe brief.")
    assert "tensors:" in ds4_cmd("kv", "show", d, names[1]).stdout
    # verify: all good
    v, rc = ds4_json("kv", "verify", d)
    assert rc == 0 and v["ok"] == 3 and v["failed"] == 0
    # stats
    st, _ = ds4_json("kv", "stats", d)
    assert (
        st["files"] == 3 and st["by_version"] == {"2": 3} and st["by_reason"] == {"cold": 1, "continued": 1, "evict": 1}
    )
    assert "reasons" in ds4_cmd("kv", "stats", d).stdout

    # damage one file's payload, add orphaned temp files and a stranger
    flip_payload_byte(paths[1], mask=0x01)
    tmp_ours = os.path.join(d, f".{'a' * 40}.kv.tmp.{dead_pid()}.{pid_space()}.deadbeef")
    tmp_ds4 = os.path.join(d, f"{'b' * 40}.kv.tmp.12345")
    tmp_live = os.path.join(d, f".{'c' * 40}.kv.tmp.{os.getpid()}.{pid_space()}.beef")
    for t in (tmp_ours, tmp_ds4, tmp_live):
        with open(t, "wb") as f:
            f.write(b"partial")
    old = time.time() - 7200
    os.utime(tmp_ds4, (old, old))
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("not a checkpoint")

    p = ds4_cmd("kv", "verify", d, check=False)
    assert p.returncode == 1
    assert f"FAIL  {names[1]}" in p.stdout and "payload_checksum" in p.stdout
    v, rc = ds4_json("kv", "verify", d, check=False)
    assert (
        rc == 1
        and v["failed"] == 1
        and v["files"][[f["name"] for f in v["files"]].index(names[1])]["code"] == "payload_checksum"
    )
    assert ds4_cmd("kv", "verify", d, names[0], names[2]).returncode == 0
    ls, _ = ds4_json("kv", "ls", d)  # ls reads headers only: the payload damage is not claimed ok
    assert len(ls["temp_files"]) == 3
    assert {f["name"]: f["status"] for f in ls["files"]}[names[1]] == "unverified"
    assert "unverified" in ds4_cmd("kv", "ls", d).stdout
    ls, _ = ds4_json("kv", "ls", d, "--verify")  # what a load would decide
    by = {f["name"]: f for f in ls["files"]}
    assert by[names[1]]["status"] == "corrupt" and by[names[1]]["error"]["code"] == "payload_checksum"
    assert by[names[0]]["status"] == by[names[2]]["status"] == "ok"
    assert "corrupt:payload_checksum" in ds4_cmd("kv", "ls", d, "--verify").stdout
    st, _ = ds4_json("kv", "stats", d, "--verify")
    assert st["ok"] == 2 and st["unverified"] == 0 and st["unusable"] == {"corrupt": 1}
    show, rc = ds4_json("kv", "show", d, names[1], "--verify", check=False)
    assert rc == 1 and show["status"] == "corrupt"
    show, rc = ds4_json("kv", "show", d, names[1])
    assert rc == 0 and show["status"] == "unverified"
    # verify FILE: one file, as a load would judge it
    p = ds4_cmd("kv", "verify", paths[1], check=False)
    assert p.returncode == 1 and f"FAIL  {names[1]}" in p.stdout and "payload_checksum" in p.stdout
    v, rc = ds4_json("kv", "verify", paths[0])
    assert rc == 0 and v["ok"] == 1 and v["files"][0]["name"] == names[0]
    # gc: dry run changes nothing
    g, _ = ds4_json("kv", "gc", d, "--dry-run")
    assert [r["name"] for r in g["removed_corrupt"]] == [names[1]] and os.path.exists(paths[1])
    # gc: corrupt file and dead/stale temp files go; the live writer's temp file and strangers stay
    g, _ = ds4_json("kv", "gc", d)
    assert [r["name"] for r in g["removed_corrupt"]] == [names[1]] and g["removed_corrupt"][0][
        "code"
    ] == "payload_checksum"
    assert sorted(g["removed_temp"]) == sorted(os.path.basename(t) for t in (tmp_ours, tmp_ds4))
    assert not os.path.exists(paths[1]) and not os.path.exists(tmp_ours) and not os.path.exists(tmp_ds4)
    assert os.path.exists(tmp_live) and os.path.exists(os.path.join(d, "notes.txt"))
    assert ds4_cmd("kv", "verify", d).returncode == 0
    # gc to a budget smaller than one file: eviction by ds4's score
    sizes = {n: os.path.getsize(os.path.join(d, n)) for n in (names[0], names[2])}
    budget = (max(sizes.values()) + 100) / 2**20
    g, _ = ds4_json("kv", "gc", d, "--budget-mb", f"{budget:.6f}")
    left = sorted(f for f in os.listdir(d) if f.endswith(".kv") and not f.startswith("."))
    assert len(g["evicted"]) == 1 and len(left) == 1 and g["bytes_after"] <= budget * 2**20
    # rm: by prefix, unknown names fail
    p = ds4_cmd("kv", "rm", d, "ffffffff", check=False)
    assert p.returncode == 1 and "no checkpoint matches" in p.stderr
    r, rc = ds4_json("kv", "rm", d, left[0][:8])
    assert rc == 0 and r["removed"] == [left[0]] and not os.path.exists(os.path.join(d, left[0]))
    assert not any(f.endswith(".kv") and not f.startswith(".") for f in os.listdir(d))
    st, _ = ds4_json("kv", "stats", d)
    assert st["files"] == 0 and st["temp_files"] == 1


# ---------------------------------------------------------------------------
# ds4 kv on ds4-server's own v1 files, built byte by byte
# ---------------------------------------------------------------------------
def _v1_bytes(
    text: bytes,
    tokens: int,
    *,
    ctx=4096,
    quant=4,
    reason=1,
    hits=3,
    created=1_700_000_000,
    last_used=1_700_000_600,
    magic=0x34565344,
    payload_tokens=None,
    extra=b"",
    cut=0,
) -> bytes:
    raw_window = 256
    fields = [
        magic,
        1,
        ctx,
        2048,
        raw_window,
        raw_window,
        1024,
        tokens if payload_tokens is None else payload_tokens,
        43,
        512,
        128,
        129280,
        min(raw_window, tokens),
    ]
    payload = struct.pack("<13I", *fields) + struct.pack(f"<{tokens}I", *range(100, 100 + tokens)) + extra
    hdr = b"KVC" + bytes([1, quant, reason, 0, 0])
    hdr += struct.pack("<III4sQQQ", tokens, hits, ctx, b"\0" * 4, created, last_used, len(payload))
    assert len(hdr) == 48
    data = hdr + struct.pack("<I", len(text)) + text + payload
    return data[: len(data) - cut] if cut else data


def _v1_dir(tmp_path):
    d = tmp_path / "v1"
    d.mkdir()
    files = {}

    def put(key, text, **kw):
        p = d / (hashlib.sha1(text).hexdigest() + ".kv")
        p.write_bytes(_v1_bytes(text, **kw))
        files[key] = str(p)

    put("good1", b"<\xef\xbd\x9cUser\xef\xbd\x9c>Hello from ds4-server, a v1 file.", tokens=12)
    put(
        "good2",
        b"<\xef\xbd\x9cUser\xef\xbd\x9c>Another conversation, longer: " + b"lorem ipsum " * 20,
        tokens=64,
        reason=2,
        hits=0,
    )
    put("bad_magic", b"a v1 file whose payload is not DSV4", tokens=8, magic=0x12345678)
    put("bad_count", b"a v1 file whose DSV4 token count differs", tokens=8, payload_tokens=9)
    put("truncated", b"a truncated v1 file", tokens=8, cut=5)
    return str(d), files


def test_kv_commands_on_a_v1_directory(tmp_path):
    d, files = _v1_dir(tmp_path)
    name = {k: os.path.basename(p) for k, p in files.items()}
    ls, _ = ds4_json("kv", "ls", d)
    by = {f["name"]: f for f in ls["files"]}
    assert len(by) == 5
    g1 = by[name["good1"]]
    assert g1["status"] == "unverified" and g1["version"] == 1 and g1["tokens"] == 12 and g1["quant_bits"] == 4
    assert g1["hits"] == 3 and g1["ctx"] == 4096 and g1["last_used"] == 1_700_000_600 and g1["reason"] == "cold"
    assert "Hello from ds4-server" in g1["preview"]
    assert by[name["truncated"]]["status"] == "corrupt" and by[name["truncated"]]["error"]["code"] == "truncated"
    out = ds4_cmd("kv", "ls", d).stdout
    assert name["good1"][:12] in out and "v1" in out and "corrupt:truncated" in out
    # show: header, DSV4 fields and text
    show, rc = ds4_json("kv", "show", d, name["good2"])
    assert rc == 0 and show["version"] == 1 and show["tokens"] == 64 and show["reason"] == "continued"
    assert show["dsv4"]["magic"] == 0x34565344 and show["dsv4"]["layers"] == 43 and show["dsv4"]["tokens"] == 64
    assert show["dsv4"]["vocab"] == 129280 and show["dsv4"]["raw_live"] == 64
    assert show["text"].startswith("<｜User｜>Another conversation")  # noqa: RUF001 (ds4's own markers)
    txt = ds4_cmd("kv", "show", os.path.join(d, name["good1"])).stdout
    assert "DSV4 payload header" in txt and "0x34565344" in txt and "Hello from ds4-server" in txt
    # verify: the full pipeline (DSV4 decode) finds the bad payloads
    v, rc = ds4_json("kv", "verify", d, check=False)
    assert rc == 1 and v["ok"] == 2 and v["failed"] == 3
    codes = {f["name"]: f.get("code") for f in v["files"]}
    assert codes[name["bad_magic"]] == "bad_v1_payload" and codes[name["bad_count"]] == "bad_v1_payload"
    assert codes[name["truncated"]] == "truncated"
    assert ds4_cmd("kv", "verify", d, name["good1"], name["good2"]).returncode == 0
    # stats
    st, _ = ds4_json("kv", "stats", d)
    assert st["files"] == 5 and st["unverified"] == 4 and st["ok"] == 0
    assert st["by_version"] == {"1": 4} and st["unusable"] == {"corrupt": 1}
    st, _ = ds4_json("kv", "stats", d, "--verify")  # the DSV4 decode finds the two bad payloads
    assert st["ok"] == 2 and st["unverified"] == 0 and st["unusable"] == {"corrupt": 3}
    # the text hash is the v1 file's only text check: a renamed file is a mismatch
    os.rename(files["good1"], os.path.join(d, "0" * 40 + ".kv"))
    v, rc = ds4_json("kv", "verify", d, check=False)
    assert rc == 1 and {f["code"] for f in v["files"] if not f["ok"]} >= {"name_mismatch"}
    os.rename(os.path.join(d, "0" * 40 + ".kv"), files["good1"])
    # gc removes the three damaged files, keeps the good ones
    g, _ = ds4_json("kv", "gc", d)
    assert sorted(r["name"] for r in g["removed_corrupt"]) == sorted(
        [name["bad_magic"], name["bad_count"], name["truncated"]]
    )
    # (removals take the store's lock: its lock file is the one other entry)
    assert sorted(os.listdir(d)) == sorted([name["good1"], name["good2"], ".ds4.lock"])
    v, rc = ds4_json("kv", "verify", d)
    assert rc == 0 and v["ok"] == 2
    # rm
    r, rc = ds4_json("kv", "rm", d, "--all")
    assert rc == 0 and sorted(r["removed"]) == sorted([name["good1"], name["good2"]]) and os.listdir(d) == [".ds4.lock"]


def test_kv_usage_errors(tmp_path):
    p = ds4_cmd("kv", "ls", tmp_path / "missing", check=False)
    assert p.returncode == 2 and "not a directory" in p.stderr
    assert ds4_cmd("kv", "show", tmp_path, check=False).returncode == 2


# -- ds4 kv lookup: the longest stored prefix of a prompt -----------------------------
def test_kv_lookup_finds_the_longest_stored_prefix(tmp_path):
    d, paths = _v2_dir(tmp_path)  # 64, 128 and every token of one conversation
    cks = {os.path.basename(p): open_checkpoint(p, load_payload=False) for p in paths}
    longest = max(cks, key=lambda n: cks[n].text_bytes)
    short = min(cks, key=lambda n: cks[n].text_bytes)
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(bytes(cks[longest].text) + b" and a new turn")
    r, rc = ds4_json("kv", "lookup", d, prompt)
    assert rc == 0 and r["hit"] and r["name"] == longest
    assert (r["tokens"], r["text_bytes"], r["reason"]) == (cks[longest].tokens, cks[longest].text_bytes, "evict")
    assert r["prompt_bytes"] == cks[longest].text_bytes + len(b" and a new turn")
    # a prompt that leaves the conversation after the shortest one: that one
    prompt.write_bytes(bytes(cks[short].text) + b"\x01 something else")
    r, rc = ds4_json("kv", "lookup", d, prompt)
    assert rc == 0 and (r["name"], r["reason"], r["tokens"]) == (short, "cold", 64)
    p = ds4_cmd("kv", "lookup", d, prompt)
    assert p.stdout.startswith(f"hit {short} tokens=64 text_bytes={cks[short].text_bytes} reason=cold")
    # a miss: exit 1, said so
    prompt.write_bytes(b"a prompt nothing was stored for")
    r, rc = ds4_json("kv", "lookup", d, prompt, check=False)
    assert rc == 1 and not r["hit"] and r["name"] is None
    p = ds4_cmd("kv", "lookup", d, prompt, check=False)
    assert p.returncode == 1 and p.stdout.startswith("miss:")


def test_kv_lookup_usage_errors(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"some prompt")
    p = ds4_cmd("kv", "lookup", tmp_path / "missing", prompt, check=False)
    assert p.returncode == 2 and "not a directory" in p.stderr and not (tmp_path / "missing").exists()
    p = ds4_cmd("kv", "lookup", tmp_path, tmp_path / "no-prompt.txt", check=False)
    assert p.returncode == 2 and "cannot read the prompt file" in p.stderr
    p = ds4_cmd("kv", "lookup", tmp_path, check=False)
    assert p.returncode == 2  # argparse: PROMPT_FILE is required


# -- ds4 kv gc: ds4 serve's eviction knobs ------------------------------------------
def _two_files(d, write_ck, a, b):
    """Two checkpoints of about one size (within 4 %), ``a`` and ``b`` as
    (text, reason, tokens, age in s); the budget that keeps one of them."""
    now = int(time.time())

    def arrays(n):  # the tokens a load checks, padded to one size
        return {"tokens": np.arange(n, dtype=np.int32), "pad": np.zeros(4 * (101 - n), np.uint8)}

    paths = [
        write_ck(d, text, arrays(tokens), reason=reason, tokens=tokens, created=now - age)
        for text, reason, tokens, age in (a, b)
    ]
    sizes = [os.path.getsize(p) for p in paths]
    assert max(sizes) < 1.04 * min(sizes)
    return [os.path.basename(p) for p in paths], f"{(max(sizes) + 100) / 2**20:.6f}"


def test_gc_keeps_a_young_never_hit_file_by_the_fresh_guard(tmp_path, write_ck):
    # the young file scores a tenth of the old one: the guard (60 s, the
    # default as ds4 serve's) spares it, no guard evicts it
    (old, young), budget = _two_files(
        tmp_path, write_ck, ("an old snapshot", "continued", 100, 3600), ("a new snapshot.", "continued", 10, 0)
    )
    for flags, evicted in (((), old), (("--kv-fresh-guard-s", "60"), old), (("--kv-fresh-guard-s", "0"), young)):
        g, _ = ds4_json("kv", "gc", tmp_path, "--budget-mb", budget, *flags, "--dry-run")
        assert g["evicted"] == [evicted], flags
    g, _ = ds4_json("kv", "gc", tmp_path, "--budget-mb", budget, "--kv-fresh-guard-s", "0")
    assert g["evicted"] == [young] and sorted(n for n in os.listdir(tmp_path) if n.endswith(".kv")) == [old]


def test_gc_weighs_an_explicit_checkpoint_as_the_server(tmp_path, write_ck):
    # the cold file scores half the continued one by ds4's formula: the
    # weight 4 (the default) keeps it, the weight 1 (ds4's one score) evicts it
    (cold, cont), budget = _two_files(
        tmp_path, write_ck, ("a cold prefix", "cold", 50, 3600), ("a continued 1", "continued", 100, 3600)
    )
    for flags, evicted in (((), cont), (("--kv-explicit-weight", "4"), cont), (("--kv-explicit-weight", "1"), cold)):
        g, _ = ds4_json("kv", "gc", tmp_path, "--budget-mb", budget, *flags, "--dry-run")
        assert g["evicted"] == [evicted], flags
    g, _ = ds4_json("kv", "gc", tmp_path, "--budget-mb", budget, "--kv-explicit-weight", "1")
    assert g["evicted"] == [cold] and sorted(n for n in os.listdir(tmp_path) if n.endswith(".kv")) == [cont]


@pytest.mark.parametrize(
    ("flag", "value", "msg"),
    [("--kv-explicit-weight", "0.5", "must be >= 1"), ("--kv-fresh-guard-s", "-1", "must be >= 0")],
)
def test_gc_refuses_the_knobs_ds4_serve_refuses(tmp_path, write_ck, flag, value, msg):
    write_ck(tmp_path, "a checkpoint gc keeps")
    p = ds4_cmd("kv", "gc", tmp_path, "--budget-mb", "1", flag, value, check=False)
    assert p.returncode == 2 and f"{flag} {msg}" in p.stderr
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".kv")]) == 1


@pytest.mark.parametrize("n", [-1, 0, 40, 49, 32769])
def test_bench_refuses_sizes_it_cannot_build(n):
    """Below the smallest chat prompt (50 tokens with the reference
    engine's template) the prompt builder used to loop forever."""
    p = ds4_cmd("bench", "--tokens", n, "--sha-mb", 1, check=False, timeout=60)
    assert p.returncode == 2 and "--tokens must be between 50 and 32768" in p.stderr


def test_bench_at_the_smallest_size(tmp_path):
    rows = json.loads(ds4_cmd("bench", "--tokens", 50, "--sha-mb", 1, "--kv-disk-dir", tmp_path, "--json").stdout)
    names = [r["name"] for r in rows]
    assert "TTFT cold (50 tokens, full prefill)" in names
    assert any(n.startswith("TTFT resumed from disk") and n.endswith("rung=disk)") for n in names)


def test_bench_quick(tmp_path):
    """Structural facts of the bench, not timings: the prompt has the
    requested size, the resumed run came from disk and prefilled only the
    follow-up, the checkpoint kept on disk is the one described (tokens,
    text, size) and was loaded exactly once, units are consistent and the
    speed-up row is the ratio of the two rows it summarises."""
    import math

    from ds4.cli.term import human_bytes as _human_bytes

    kv = tmp_path / "kv"
    rows = json.loads(ds4_cmd("bench", "--tokens", 512, "--sha-mb", 4, "--kv-disk-dir", kv, "--json").stdout)
    assert all(isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] > 0 for r in rows), rows

    def row(pattern):
        found = [(r, m) for r in rows for m in [re.fullmatch(pattern, r["name"])] if m]
        assert len(found) == 1, (pattern, [r["name"] for r in rows])
        return found[0]

    cold, m = row(r"TTFT cold \((\d+) tokens, full prefill\)")
    n = int(m.group(1))
    assert n == 512 and cold["unit"] == "ms"
    save, m = row(r"checkpoint save \((.+), fsync\)")
    save_size = m.group(1)
    assert save["unit"] == "ms"
    assert row(r"checkpoint verify \+ load")[0]["unit"] == "ms"
    resumed, m = row(r"TTFT resumed from disk \(\+(\d+) new tokens, rung=(\w+)\)")
    new_tokens, rung = int(m.group(1)), m.group(2)
    assert rung == "disk" and 0 < new_tokens < n and resumed["unit"] == "ms"
    cold2 = row(r"TTFT same follow-up, cold")[0]
    speed = row(r"speed-up resumed vs cold")[0]
    assert cold2["unit"] == "ms" and speed["unit"] == "x"
    assert speed["value"] == pytest.approx(cold2["value"] / resumed["value"], rel=1e-9)
    assert row(r"SHA-1 ds4 core")[0]["unit"] == row(r"SHA-1 hashlib")[0]["unit"] == "MiB/s"
    one, m1 = row(r"prefix lookup, (\d+) candidates in 1 MiB: one pass")
    each, m2 = row(r"prefix lookup, (\d+) candidates in 1 MiB: hashlib each")
    assert m1.group(1) == m2.group(1) and int(m1.group(1)) > 1 and one["unit"] == each["unit"] == "ms"
    # the checkpoint the bench saved (and nothing else) is on disk
    files = [f for f in os.listdir(kv) if f.endswith(".kv")]
    assert len(files) == 1, os.listdir(kv)
    path = os.path.join(kv, files[0])
    ck = open_checkpoint(path, load_payload=False)
    assert ck.tokens == n and len(ds4.ReferenceEngine().tokenize(ck.text.decode(), special=True)) == n
    assert files[0] == checkpoint_name(hashlib.sha1(ck.text).hexdigest(), ck.abi)
    assert save_size == _human_bytes(os.path.getsize(path))
    assert ck.hits == 1, "the resumed run loads it from disk (a hit); the direct verify + load does not touch it"


# ---------------------------------------------------------------------------
# ds4 chat, through a pty
# ---------------------------------------------------------------------------
PROMPT_RE = ">>> "


def _spawn_chat(kv, *extra, max_tokens=8):
    c = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "ds4",
            "chat",
            "--engine",
            "reference",
            "--kv-disk-dir",
            str(kv),
            "--max-tokens",
            str(max_tokens),
            *KV,
            *extra,
        ],
        encoding="utf-8",
        codec_errors="replace",
        timeout=60,
        dimensions=(40, 200),
    )
    return c


def _turn(c, text):
    c.sendline(text)
    c.expect(r"\[(live|disk|prefill|rewrite)/\S+ cached=(\d+) prompt=(\d+) gen=(\d+)")
    rung, cached = c.match.group(1), int(c.match.group(2))
    c.expect(PROMPT_RE)
    return rung, cached


def test_chat_repl_save_list_switch_clear(tmp_path):
    kv = tmp_path / "kv"
    c = _spawn_chat(kv)
    try:
        c.expect("Updating system prompt cache")  # first start: prefill and store the system prompt
        c.expect(PROMPT_RE)
        rung, cached = _turn(c, "Hello there, tell me about the sea and its tides.")
        assert rung == "live" and cached > 0  # on top of the system prompt checkpoint
        c.sendline("/save sea")
        c.expect(r"\[saved sea: (\d+) tokens -> ([0-9a-f]{40})-([0-9a-f]{16})\.kv\]")
        saved_tokens, sha, tag = int(c.match.group(1)), c.match.group(2), c.match.group(3)
        c.expect(PROMPT_RE)
        _turn(c, "And what about the moon?")
        c.sendline("/list")
        c.expect(r"\*\s+sea\s+" + str(saved_tokens) + r"\s+\S+ ago\s+ok")
        c.expect(PROMPT_RE)
        c.sendline("/new")
        c.expect(r"\[system prompt: \d+ tokens loaded from checkpoint")
        c.expect(r"\[new conversation\]")
        c.expect(PROMPT_RE)
        _turn(c, "Something else entirely.")
        c.sendline("/switch sea")
        c.expect(r"\[switched to sea: (\d+) tokens loaded from disk in [\d.]+ ms, no prefill\]")
        assert int(c.match.group(1)) == saved_tokens
        c.expect(PROMPT_RE)
        rung, cached = _turn(c, "Continue, please.")
        assert rung == "live" and cached == saved_tokens  # nothing of the saved conversation prefilled
        c.sendline("/switch nope")
        c.expect(r"\[no saved session 'nope'\]")
        c.expect(PROMPT_RE)
        c.sendline("/clear")
        c.expect(r"\[history cleared; session invalidated\]")
        c.expect(PROMPT_RE)
        rung, cached = _turn(c, "Fresh start.")
        assert rung in ("prefill", "disk")
        c.sendline("/bogus")
        c.expect(r"unknown command")
        c.expect(PROMPT_RE)
        c.sendline("/quit")
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0
    idx = json.loads((kv / "ds4-chat.json").read_text())
    assert idx["sessions"]["sea"]["sha"] == sha and (kv / f"{sha}-{tag}.kv").exists()
    assert [m["role"] for m in idx["sessions"]["sea"]["messages"]] == ["system", "user", "assistant"]
    ck = open_checkpoint(kv / f"{sha}-{tag}.kv")
    assert tag == _core.model_tag(ck.abi)
    assert ck.reason_name == "named" and ck.tokens == saved_tokens

    # a new process: the system prompt checkpoint and the named session are reused
    c = _spawn_chat(kv)
    try:
        c.expect(r"\[system prompt: \d+ tokens loaded from checkpoint")
        c.expect(PROMPT_RE)
        c.sendline("/list")
        c.expect(r"sea\s+" + str(saved_tokens))
        c.expect(PROMPT_RE)
        c.sendline("/switch se")  # a unique prefix
        c.expect(r"\[switched to sea: \d+ tokens loaded from disk")
        c.expect(PROMPT_RE)
        rung, cached = _turn(c, "One more thing.")
        assert rung == "live" and cached == saved_tokens
        c.sendeof()
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0


def test_chat_ctrl_c_stops_generation_cleanly(tmp_path):
    from ds4.cli import DEFAULT_SYSTEM
    from ds4.cli.term import printable as _printable
    from ds4.turn import GenParams, TurnDriver

    question = "Write a very long story."
    eng = ds4.ReferenceEngine()
    prompt = eng.render_chat([{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": question}])
    full = TurnDriver(eng, 8192).generate(prompt, GenParams(max_tokens=2000))
    assert full.finish_reason == "stop" and full.completion_tokens > 300  # the model's own end of turn
    first = _printable(TurnDriver(eng, 8192).generate(prompt, GenParams(max_tokens=3)).text)
    kv = tmp_path / "kv"
    c = _spawn_chat(kv, "--ctx", "8192", max_tokens=6000)
    try:
        c.expect(PROMPT_RE)
        c.sendline(question)
        c.expect(re.escape(question) + r"\r\n" + re.escape(first))  # generation is under way
        c.sendintr()
        c.expect(r"gen=(\d+) \(interrupted\)")
        assert 0 < int(c.match.group(1)) < full.completion_tokens
        c.expect(PROMPT_RE)
        # the session is still usable: a normal turn, then a clean exit
        c.sendline("/save story")
        c.expect(r"\[saved story: \d+ tokens")
        c.expect(PROMPT_RE)
        c.sendline("/quit")
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0


def _greedy_cold(engine, prompt, n):
    """The demo's answer computed here, independently: a cold prefill of the
    whole prompt on a fresh engine context, then greedy decoding up to ``n``
    tokens or the end of turn (as the demo generates)."""
    import numpy as np

    ctx = engine.new_context(8192)
    logits = ctx.eval(engine.tokenize(prompt, special=True))
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        if t == engine.eos_token_id:
            break
        logits = ctx.eval([t])
    return engine.detokenize([t for t in out if t != engine.eos_token_id])


def test_demo_main_job_end_to_end(tmp_path):
    """The README's main job (on the reference engine here; the default is
    SmolLM2): three processes, cold + save, resume from disk, corruption.
    The demo's own verdicts are not trusted: its printed replies are compared
    with answers computed here, and its token counts with each other."""
    import ast
    import subprocess
    import sys

    from ds4 import demo

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds4",
            "demo",
            "--engine",
            "reference",
            "--tokens",
            "1500",
            "--align",
            "512",
            "--dir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "rung=disk" in out and "output identical to a cold prefill: True" in out
    assert "code=payload_checksum" in out and "corrupt file removed: True" in out
    assert out.rstrip().endswith("ds4 demo: OK")

    # phases 1 (cold) and 2 (resumed from disk) print their replies: compare
    # them with answers computed here (phase 3 prints none)
    replies = [ast.literal_eval(m) for m in re.findall(r"^   reply: (.*)$", out, re.M)]
    assert len(replies) == 2, out
    eng = ds4.ReferenceEngine()
    first = demo._prompt(eng, 1500, extra_turn=False)
    nxt = demo._prompt(eng, 1500, extra_turn=True)
    assert nxt.startswith(first)  # the next turn extends the saved conversation's bytes
    assert replies[0] == _greedy_cold(eng, first, demo.GEN_TOKENS)
    assert replies[1] == _greedy_cold(eng, nxt, demo.GEN_TOKENS), (
        "the reply resumed from disk differs from a cold prefill"
    )
    assert replies[1] != replies[0]

    # token counts: phase 2 reuses the whole first conversation (saved at
    # shutdown) and prefills only the new turn; phase 3 falls back to the
    # shorter, aligned cold checkpoint
    n1 = int(re.search(r"^   (\d+) prompt tokens, rung=prefill,", out, re.M).group(1))
    assert n1 == len(eng.tokenize(first, special=True))
    m2 = re.search(r"^   rung=disk, reused (\d+) of (\d+) tokens$", out, re.M)
    reused2, n2 = int(m2.group(1)), int(m2.group(2))
    assert n2 == len(eng.tokenize(nxt, special=True)) and reused2 == n1 < n2
    bad = re.search(r"^3\) corruption: flipped one payload bit in ([0-9a-f]{40}-[0-9a-f]{16}\.kv);", out, re.M).group(1)
    assert re.search(r"^   rejected " + re.escape(bad) + r": stage=payload code=payload_checksum ", out, re.M), out
    assert bad == checkpoint_name(
        hashlib.sha1(first.encode()).hexdigest(), eng.payload_abi()
    )  # the longest: the whole first conversation
    reused3 = int(re.search(r"^   rung=disk, reused (\d+) tokens; corrupt file removed: True$", out, re.M).group(1))
    assert 0 < reused3 < reused2 and reused3 % 512 == 0  # --align 512
    assert os.listdir(tmp_path / "demo").count(bad) == 0


# -- a light start: ds4 kv never loads the server, an engine, the turn, llguidance or matplotlib ---

HEAVY = ("ds4.server", "ds4.turn", "ds4.engines", "ds4.constrain", "llguidance", "matplotlib")


TIER_MODULES = ("ds4.kvstore.remote", "ds4.kvstore.remote_io", "ds4.kvstore.tiered", "ds4.kvstore.uploads")


def _modules_after(argv: list[str]) -> list[str]:
    """The modules a fresh interpreter holds after ``ds4.cli.main(argv)``."""
    code = (
        "import sys\n"
        "from ds4.cli import main\n"
        f"rc = main({argv!r})\n"
        "print('\\n'.join(sorted(sys.modules)), file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr  # 1: a verification's verdict on the test file
    return p.stderr.split()


@pytest.mark.parametrize(
    "action",
    [["ls"], ["ls", "--verify"], ["stats"], ["stats", "--plot", "-"], ["verify"], ["show", "--json"], ["lookup"]],
)
def test_kv_imports_no_server_engine_turn_llguidance_or_matplotlib(tmp_path, write_ck, action):
    path = write_ck(tmp_path, "a checkpoint that ds4 kv lists, shows and verifies")
    argv = ["kv", action[0], path if action[0] == "show" else str(tmp_path), *action[1:]]
    if action[0] == "lookup":
        (tmp_path / "prompt.bin").write_bytes(bytes(open_checkpoint(path, load_payload=False).text) + b" more")
        argv = ["kv", "lookup", str(tmp_path), str(tmp_path / "prompt.bin"), *action[1:]]
    mods = _modules_after(argv)
    assert ("ds4.cli.kvlookup" if action[0] == "lookup" else "ds4.cli.kv") in mods  # the command ran
    heavy = [m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == [], f"ds4 {' '.join(argv)} imported {heavy}"
    if action[0] == "lookup":  # a lookup makes no array: not even numpy, the session or the ladder
        light = [m for m in mods if m.split(".")[0] == "numpy" or m in ("ds4.session", "ds4.recovery", "ds4.engine")]
        assert light == [], f"ds4 {' '.join(argv)} imported {light}"
        # the parser built only the lookup's flags: not the shared ones (config), ds4 serve's or the tier's
        flags = [m for m in mods if m in ("ds4.config", "ds4.serve_args", "ds4.kvstore.remote_layout")]
        assert flags == [], f"ds4 {' '.join(argv)} imported {flags}"
    # no directory command needs the shared tier's client (its modules load when a tier is given)
    tier = [m for m in mods if m.split(".")[0] == "redis" or m in TIER_MODULES]
    assert tier == [], f"ds4 {' '.join(argv)} imported {tier}"


def test_the_parser_is_built_without_the_server():
    mods = _modules_after(["--version"])
    assert "ds4.serve_args" in mods
    assert [m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY)] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--sessions", "3", "--port", "0"],
        ["run", "-p", "hi", "--max-tokens", "3", "--kv-explicit-weight", "2"],
        ["chat", "--system", "s", "--no-kv-cache"],
        ["bench", "--concurrency", "2", "--turns", "3"],
        ["kv", "ls", "d", "--json"],
        ["kv", "gc", "d", "--budget-mb", "5", "--kv-fresh-guard-s", "0", "--dry-run"],
        ["kv", "lookup", "d", "p.bin", "--json"],
        ["kv", "stats", "--remote", "redis://h:1/0", "--namespace", "n"],
        ["kv", "pull", "d", "a", "b", "--remote", "redis://h:1/0"],
        ["kv", "verify", "d", "x", "y"],
        ["kv", "rm", "d", "--all"],
        ["kv", "show", "d", "n", "--text"],
        ["kv", "push", "d", "--remote", "redis://h:1/0", "--kv-trust-dir"],
        ["--version"],
    ],
)
def test_the_parser_built_for_a_command_parses_it_as_the_whole_parser_does(argv):
    """build_parser(argv) builds only the named command's flags: what it
    makes of the line is what the parser with every command's flags makes."""
    from ds4.cli import build_parser

    assert vars(build_parser(argv).parse_args(argv)) == vars(build_parser().parse_args(argv))


def test_the_parser_built_for_one_command_has_no_other_commands_flags():
    from ds4.cli import build_parser

    line = ["serve", "--sessions", "3"]
    assert build_parser(line).parse_args(line).cmd == "serve"
    with pytest.raises(SystemExit):  # the parser built for kv lookup has no ds4 serve flag
        build_parser(["kv", "lookup"]).parse_args(line)
