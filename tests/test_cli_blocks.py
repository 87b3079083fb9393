"""``ds4 kv`` on a store with shared blocks (``--kv-blocks on``), through
the real command: ``ls`` and ``show`` say which file is a manifest, its
blocks and the bytes it shares; ``verify`` (and ``--verify``) verifies a
manifest's blocks as a load does and every block file on its own, a
damaged block failing every manifest that names it (stage ``block``) and
a block no manifest names reported as an orphan, not a failure; ``gc``
removes orphans (``--dry-run`` keeps them) and plans an eviction as the
store runs it; ``stats`` counts blocks and the dedup ratio."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers.checkpoints import flip_byte
from helpers.kv import prefilled, toks
from helpers.procs import ds4_cmd, ds4_json

import ds4
from ds4 import _core
from ds4.kvstore.blocks import BLOCKS_DIR, MANIFEST_FLAG

B = 16  # tokens per block (the reference engine's granule is 1)
BASE = " ".join(["alpha beta gamma delta epsilon zeta eta theta"] * 30)
TEXTS = (BASE + " first task one", BASE + " second task two")
SINGLE = "a single file of its own, " * 12


@pytest.fixture(scope="module")
def built(tmp_path_factory, eng):
    """A store with two manifests of one prefix (sharing its blocks) and a
    single file, written once; each test gets a copy."""
    d = tmp_path_factory.mktemp("blocks") / "kv"
    store = ds4.KVStore(str(d), min_tokens=8, blocks=True, block_tokens=B)
    names = []
    for t in TEXTS:
        path = store.store_live_checked(prefilled(eng, t), "cold")
        assert isinstance(path, str)
        names.append(os.path.basename(path))
    single = ds4.KVStore(str(d), min_tokens=8).store_live_checked(prefilled(eng, SINGLE), "cold")
    assert isinstance(single, str)
    ta, tb = (toks(eng, t) for t in TEXTS)
    shared = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y) // B
    return d, names, os.path.basename(single), shared, (len(ta) // B, len(tb) // B)


@pytest.fixture
def kv(built, tmp_path):
    d, names, single, shared, counts = built
    dst = tmp_path / "kv"
    shutil.copytree(d, dst)
    return dst, names, single, shared, counts


def _blocks(d) -> list[str]:
    return sorted(f[:64] for f in os.listdir(os.path.join(d, BLOCKS_DIR)) if f.endswith(".kvb"))


def _table(path):
    ck = ds4.open_checkpoint(path)
    return _core.read_block_table(ck.array("ds4.blocks"))


def test_ls_and_show_say_which_file_is_a_manifest_and_what_it_shares(kv):
    d, names, single, shared, counts = kv
    per_block = _table(d / names[0])[1][0][2]
    ls, _ = ds4_json("kv", "ls", d)
    files = {f["name"]: f for f in ls["files"]}
    assert files[single]["manifest"] is False and "blocks" not in files[single]
    for name, n in zip(names, counts, strict=True):
        f = files[name]
        assert f["manifest"] is True and f["flags"] & MANIFEST_FLAG
        assert (f["blocks"], f["block_tokens"], f["block_bytes"]) == (n, B, n * per_block)
        assert (f["shared_blocks"], f["shared_block_bytes"]) == (shared, shared * per_block)
        assert f["missing_blocks"] == 0 and f["status"] == "unverified"
    out = ds4_cmd("kv", "ls", d).stdout
    assert "BLOCKS" in out.splitlines()[0] and f"{counts[0]} ({shared} shared)" in out
    assert f"{len(_blocks(d))} block files" in out
    show, rc = ds4_json("kv", "show", d / names[1])
    assert rc == 0 and show["blocks"] == counts[1] and show["shared_block_bytes"] == shared * per_block
    text = ds4_cmd("kv", "show", d, names[0][:12]).stdout
    assert f"manifest         {counts[0]} blocks of {B} tokens" in text and "shared with other checkpoints" in text
    assert "manifest " not in ds4_cmd("kv", "show", d, single[:12]).stdout
    # a shared block gone: both manifests say so, from their tables alone
    assert shared > 0
    os.unlink(os.path.join(d, BLOCKS_DIR, _table(d / names[0])[1][0][0].hex() + ".kvb"))
    ls, _ = ds4_json("kv", "ls", d)
    assert {f["name"]: f.get("missing_blocks") for f in ls["files"]} == {names[0]: 1, names[1]: 1, single: None}
    assert "1 missing" in ds4_cmd("kv", "ls", d).stdout


def test_verify_checks_the_blocks_and_a_damaged_one_fails_its_manifests(kv):
    d, names, single, shared, counts = kv
    out, rc = ds4_json("kv", "verify", d)
    assert rc == 0 and out["failed"] == 0 and out["ok"] == 3
    assert out["blocks_ok"] == len(_blocks(d)) == sum(counts) - shared and out["orphan_blocks"] == 0
    assert "blocks: " in ds4_cmd("kv", "verify", d).stdout
    first = _table(d / names[0])[1][0][0].hex()  # block 0: named by both manifests
    assert shared > 0
    flip_byte(os.path.join(d, BLOCKS_DIR, first + ".kvb"), -7, 0x10)  # in the payload (no MAC trailer)
    out, rc = ds4_json("kv", "verify", d, check=False)
    assert rc == 1 and out["failed"] == 2 and out["blocks_failed"] == 1
    files = {f["name"]: f for f in out["files"]}
    for n in names:
        f = files[n]
        assert not f["ok"] and (f["status"], f["stage"], f["code"], f["block"]) == (
            "corrupt",
            "block",
            "block_checksum",
            first,
        )
    assert files[single]["ok"]
    (bad,) = [b for b in out["blocks"] if not b["ok"]]
    assert (bad["name"], bad["code"], bad["orphan"]) == (first, "block_checksum", False)
    # one manifest by name, --verify on ls and show: the same verdict
    one, rc = ds4_json("kv", "verify", d, names[1][:12], check=False)
    assert rc == 1 and one["files"][0]["code"] == "block_checksum" and one["blocks"] == []
    ls, _ = ds4_json("kv", "ls", d, "--verify")
    assert {f["name"]: f["status"] for f in ls["files"]} == {names[0]: "corrupt", names[1]: "corrupt", single: "ok"}
    assert "corrupt:block_checksum" in ds4_cmd("kv", "ls", d, "--verify").stdout
    show, rc = ds4_json("kv", "show", d / names[0], "--verify", check=False)
    assert rc == 1 and show["error"]["code"] == "block_checksum" and show["error"]["block"] == first
    # gc keeps the manifests (a later save of the same tokens makes them whole)
    ds4_cmd("kv", "gc", d)
    assert {names[0], names[1], single} <= set(os.listdir(d))


def test_a_table_that_does_not_name_its_tokens_blocks_fails_verify(kv):
    d, names, _single, _shared, _counts = kv
    path = d / names[0]
    ck = ds4.open_checkpoint(path)
    arrays = {k: np.array(v) for k, v in ck.arrays().items()}
    block, recs = _core.read_block_table(arrays["ds4.blocks"])
    recs[0], recs[1] = recs[1], recs[0]
    arrays["ds4.blocks"] = np.frombuffer(_core.block_table(block, recs), np.uint8)
    ds4.write_checkpoint(path, bytes(ck.text), arrays, abi=ck.abi, tokens=ck.tokens, ctx=ck.ctx, flags=MANIFEST_FLAG)
    del ck
    out, rc = ds4_json("kv", "verify", d, check=False)
    assert rc == 1 and out["failed"] == 1
    (f,) = [f for f in out["files"] if not f["ok"]]
    assert (f["name"], f["stage"], f["code"]) == (names[0], "payload", "block_table")


def test_an_orphan_block_is_reported_by_verify_and_removed_by_gc(kv):
    d, names, _single, _shared, _counts = kv
    abi = ds4.open_checkpoint(d / names[0], load_payload=False).abi
    orphan = "ab" * 32
    _core.write_block(os.path.join(d, BLOCKS_DIR), bytes.fromhex(orphan), B, abi, b"\x01" * 4096)
    n = len(_blocks(d))
    out, rc = ds4_json("kv", "verify", d)
    assert rc == 0 and out["failed"] == out["blocks_failed"] == 0 and out["orphan_blocks"] == 1
    (o,) = [b for b in out["blocks"] if b["orphan"]]
    assert o["name"] == orphan and o["ok"]
    text = ds4_cmd("kv", "verify", d).stdout
    assert f"ORPHAN block {orphan[:16]}" in text and "1 orphans" in text
    stats, _ = ds4_json("kv", "stats", d)
    assert stats["orphan_blocks"] == 1
    dry, _ = ds4_json("kv", "gc", d, "--dry-run")
    assert dry["removed_orphan_blocks"] == [orphan] and len(_blocks(d)) == n
    assert f"would remove orphan block {orphan}" in ds4_cmd("kv", "gc", d, "--dry-run").stdout
    gc, _ = ds4_json("kv", "gc", d)
    assert gc["removed_orphan_blocks"] == [orphan] and gc["bytes_after"] < gc["bytes_before"]
    assert orphan not in _blocks(d) and len(_blocks(d)) == n - 1
    out, rc = ds4_json("kv", "verify", d)  # every manifest still whole
    assert rc == 0 and out["ok"] == 3 and out["orphan_blocks"] == 0


def test_stats_counts_blocks_and_the_dedup_ratio(kv):
    d, names, _single, shared, counts = kv
    st, _ = ds4_json("kv", "stats", d)
    sizes = {n: os.path.getsize(d / n) for n in os.listdir(d) if n.endswith(".kv")}
    blocks = [os.path.getsize(os.path.join(d, BLOCKS_DIR, h + ".kvb")) for h in _blocks(d)]
    payloads = sum(r[2] for n in names for r in _table(d / n)[1])
    assert st["manifests"] == 2 and st["manifest_bytes"] == sum(sizes[n] for n in names)
    assert st["block_files"] == len(blocks) == sum(counts) - shared and st["block_files_bytes"] == sum(blocks)
    assert st["disk_bytes"] == st["bytes"] + sum(blocks)
    assert st["single_file_bytes"] == st["bytes"] + payloads
    assert st["dedup_ratio"] == pytest.approx(st["single_file_bytes"] / st["disk_bytes"]) and st["dedup_ratio"] > 1
    assert "dedup          " in ds4_cmd("kv", "stats", d).stdout


@pytest.mark.parametrize("share", [0.95, 0.6])
def test_gc_dry_run_plans_the_eviction_the_store_runs(kv, share):
    d, _names, _single, _shared, _counts = kv
    total = sum(os.path.getsize(d / n) for n in os.listdir(d) if n.endswith(".kv"))
    total += sum(os.path.getsize(os.path.join(d, BLOCKS_DIR, h + ".kvb")) for h in _blocks(d))
    budget = str(total * share / 2**20)
    dry, _ = ds4_json("kv", "gc", d, "--budget-mb", budget, "--dry-run")
    n = len(_blocks(d))
    real, _ = ds4_json("kv", "gc", d, "--budget-mb", budget)
    assert dry["evicted"] == real["evicted"] and dry["evicted"]
    assert dry["evicted_blocks"] == real["evicted_blocks"] == n - len(_blocks(d))
    assert real["bytes_after"] <= total * share
    out, rc = ds4_json("kv", "verify", d)  # what stays loads whole
    assert rc == 0 and out["orphan_blocks"] == 0


def test_ls_stats_and_show_of_a_manifest_import_no_numpy(kv):
    d, names, _single, _shared, _counts = kv
    for argv in (["ls", str(d)], ["stats", str(d)], ["show", str(d / names[0]), "--json"]):
        code = (
            "import sys, io, contextlib\n"
            "from ds4.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main({['kv', *argv]!r})\n"
            "print(rc, 'numpy' in sys.modules)\n"
        )
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        assert p.stdout.split() == ["0", "False"], (argv, p.stdout, p.stderr)
