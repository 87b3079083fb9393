"""``ds4 kv ls|stats|verify|gc|rm --remote URL``, ``kv push`` and ``kv pull``
against a real redis-server."""

from __future__ import annotations

import json
import os

import pytest

import ds4
from ds4.cli import main
from ds4.kvstore import KVStore
from ds4.kvstore.remote import KeyLayout


def _fill(directory, n=3):
    eng = ds4.ReferenceEngine()
    st = KVStore(directory, min_tokens=8)
    paths = []
    for i in range(n):
        s = ds4.Session(eng, ctx=1024)
        s.sync(eng.tokenize(" ".join(f"cli-{i}-{j}" for j in range(20 + 5 * i)), special=True))
        paths.append(st.store_live_prefix(s, "cold"))
    return paths, s.payload_abi


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_push_ls_stats_verify_pull_gc_rm(tmp_path, node, capsys):
    with node.client() as c:
        c.flushall()
    paths, abi = _fill(tmp_path / "src")
    url = node.url
    rc, out, _ = _run(capsys, "kv", "push", str(tmp_path / "src"), "--remote", url, "--json")
    assert rc == 0 and json.loads(out) == {"stored": 3}
    rc, out, _ = _run(capsys, "kv", "push", str(tmp_path / "src"), "--remote", url, "--json")
    assert json.loads(out) == {"present": 3}
    rc, out, _ = _run(capsys, "kv", "ls", "--remote", url, "--json")
    doc = json.loads(out)
    assert rc == 0 and sorted(f["name"] for f in doc["files"]) == sorted(os.path.basename(p) for p in paths)
    assert all(f["abi"] == abi for f in doc["files"])
    rc, out, _ = _run(capsys, "kv", "stats", "--remote", url, "--json")
    assert json.loads(out)["files"] == 3 and json.loads(out)["bytes"] == sum(os.path.getsize(p) for p in paths)
    rc, out, _ = _run(capsys, "kv", "verify", "--remote", url)
    assert rc == 0 and "3 verified, 0 failed" in out
    rc, out, _ = _run(capsys, "kv", "pull", str(tmp_path / "dst"), "--remote", url, "--json")
    assert rc == 0 and len(json.loads(out)["pulled"]) == 3
    for p in paths:
        with open(p, "rb") as a, open(tmp_path / "dst" / os.path.basename(p), "rb") as b:
            assert a.read() == b.read()
    # damage: a flipped chunk fails verify (and is deleted), a vanished manifest is pruned by gc
    keys = KeyLayout("shared", abi)
    sha0, sha1 = os.path.basename(paths[0])[:40], os.path.basename(paths[1])[:40]
    with node.client() as c:
        v = bytearray(c.get(keys.chunk(sha0, 0)))
        v[500] ^= 1
        c.set(keys.chunk(sha0, 0), bytes(v))
        c.delete(keys.manifest(sha1))
    rc, out, _ = _run(capsys, "kv", "verify", "--remote", url)
    assert rc == 1 and "1 verified, 1 failed" in out and "remote_chunk" in out
    rc, out, _ = _run(capsys, "kv", "gc", "--remote", url, "--json")
    assert json.loads(out)["pruned"] == 1
    rc, out, _ = _run(capsys, "kv", "ls", "--remote", url, "--json")
    (left,) = json.loads(out)["files"]
    assert left["name"] == os.path.basename(paths[2])
    rc, out, _ = _run(capsys, "kv", "rm", left["name"][:10], "--remote", url)
    assert rc == 0 and "removed" in out
    with node.client() as c:
        assert c.keys("ds4:*") == []
    rc, _, err = _run(capsys, "kv", "ls")
    assert rc == 2 and "--remote" in err


def test_remote_unreachable_is_one_line(capsys):
    from helpers.ports import free_port

    rc, _, err = _run(capsys, "kv", "ls", "--remote", f"redis://127.0.0.1:{free_port()}/0")
    assert rc == 1 and "cannot be read" in err and "Traceback" not in err


def test_run_with_kv_remote_resumes_on_another_directory(tmp_path, node, capsys):
    with node.client() as c:
        c.flushall()
    prompt = " ".join(f"word{i}" for i in range(120))
    common = ["run", "--engine", "reference", "--ctx", "1024", "--max-tokens", "2", "--json"]
    kv = ["--kv-cache-min-tokens", "16", "--kv-cache-boundary-align-tokens", "32", "--kv-remote", node.url]
    rc, out, _ = _run(capsys, *common, "-p", prompt, "--kv-disk-dir", str(tmp_path / "a"), *kv)
    first = json.loads(out)
    assert rc == 0 and first["report"]["rung"] == "prefill" and first["report"]["cold_saved"]
    # the store was closed on exit: its upload is done
    rc, out, _ = _run(capsys, *common, "-p", prompt, "--kv-disk-dir", str(tmp_path / "b"), *kv)
    second = json.loads(out)
    assert rc == 0 and second["report"]["rung"] == "remote" and second["report"]["remote"] == "up"
    assert second["text"] == first["text"] and second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    rc, _, err = _run(capsys, *common, "-p", prompt, "--kv-remote", node.url)
    assert rc == 2 and "--kv-disk-dir" in err


@pytest.mark.parametrize(
    "flags", [("--kv-explicit-weight", "4"), ("--kv-fresh-guard-s", "60"), ("--kv-fresh-guard-s", "0")]
)
def test_remote_gc_refuses_the_directory_eviction_flags(capsys, flags):
    """The tier's TTL evicts, not the store's order: a given policy flag
    (even at its default value) is refused before anything is contacted,
    instead of being ignored."""
    from helpers.ports import free_port

    rc, _, err = _run(capsys, "kv", "gc", "--remote", f"redis://127.0.0.1:{free_port()}/0", *flags)
    assert rc == 2 and "--kv-explicit-weight and --kv-fresh-guard-s order a directory's eviction" in err
