"""One store, many models (issue 42): two GGUFs that render the same text
into the same bytes (SmolLM2 and a copy with one weight byte changed: same
tokenizer and template, another fingerprint) share one cache directory.
Each keeps and resumes its own checkpoint of a text, in new processes; a
directory an earlier release wrote (``<sha1>.kv``, a version 2 index)
resumes after the upgrade and gets no duplicate; one model's file is never
loaded into the other."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from helpers import models
from helpers.checkpoints import stored_name
from helpers.redis_servers import RedisNode
from helpers.server import Server

from ds4 import _core
from ds4.checkpoint import open_checkpoint
from ds4.cli.kvmodels import file_fingerprint, model_of
from ds4.kvstore import is_checkpoint_name
from ds4.kvstore.files import legacy_name

#: each test starts several processes that load and probe a model: minutes
#: on a machine that runs other jobs
pytestmark = pytest.mark.timeout(900)

#: a raw prompt of about 650 SmolLM2 tokens
PROMPT = " ".join(
    f"Line {i}: the harbour master logs ship {i * 7 % 13} at the tide of hour {i % 24}." for i in range(40)
)
GEN = 40


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    return models.twin_model(str(tmp_path_factory.mktemp("twin")))


def run(model: str, kv, prompt: str = PROMPT, *extra: str) -> dict:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds4",
            "run",
            "--engine",
            "llamacpp",
            "--model",
            model,
            "--raw",
            "-p",
            prompt,
            "--kv-disk-dir",
            str(kv),
            "--max-tokens",
            str(GEN),
            "--ctx",
            "2048",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def kv_files(kv) -> list[str]:
    return sorted(f for f in os.listdir(kv) if is_checkpoint_name(f))


def _moved(report: dict, src, dst) -> dict:
    """``report`` with the paths under directory ``src`` named under ``dst``."""
    return json.loads(json.dumps(report).replace(os.path.join(str(src), ""), os.path.join(str(dst), "")))


@pytest.fixture(scope="module")
def a_first(tmp_path_factory):
    """``a_first(kv, copy_ok=False) -> report``: A's first run (``run(A,
    kv)``: a cold prefill that saves its checkpoint) on the empty directory
    ``kv``, made once for the tests that start from it. The first test runs
    it in its own directory, and a copy of the directory as that process
    left it is kept for a later test that takes a copy (``copy_ok``: the
    copy's index file names another directory, by its inode, and is rebuilt
    from the headers: fine for a test that rebuilds it anyway), handed over
    by a rename; any other test runs A itself. The report's paths name the
    taker's directory."""
    spare: dict[str, dict] = {}

    def first(kv, copy_ok=False):
        if copy_ok and spare:
            src, report = spare.popitem()
            os.rename(src, kv)
            return _moved(report, src, kv)
        report = run(models.model_path("smollm2"), kv)
        if not spare:
            d = str(tmp_path_factory.mktemp("a-first") / "kv")
            shutil.copytree(kv, d, symlinks=True)
            spare[d] = _moved(report, kv, d)
        return report

    return first


def test_two_models_keep_and_resume_their_own_checkpoint_of_one_text(twin, a_first, tmp_path):
    """A, B, A, B on one directory, each a new process: each model's cold run
    saves its own file (B's is not refused for A's name), each second run
    resumes from its own file from disk with its own cold run's tokens, and
    neither loads the other's."""
    a_model, kv = models.model_path("smollm2"), tmp_path / "kv"
    abi_a, abi_b = models.engine("smollm2").payload_abi(), None
    a1 = a_first(kv)  # run(a_model, kv)
    assert a1["report"]["rung"] == "prefill" and a1["report"]["cold_saved"]
    b1 = run(twin, kv)
    rep = b1["report"]
    assert rep["rung"] == "prefill" and rep["cold_saved"], rep  # saved beside A's, not refused
    abi_b = open_checkpoint(rep["cold_saved"], load_payload=False).abi
    assert abi_b != abi_a
    a_ck, b_ck = (open_checkpoint(r["report"]["cold_saved"], load_payload=False) for r in (a1, b1))
    assert a_ck.text == b_ck.text  # the same key text: one SHA-1, two files
    sha = _core.sha1_hex(a_ck.text)
    assert kv_files(kv) == sorted([stored_name(a_ck.text, abi_a), stored_name(a_ck.text, abi_b)])
    assert all(f.startswith(sha + "-") for f in kv_files(kv))
    a2, b2 = run(a_model, kv), run(twin, kv)
    for first, second, path in ((a1, a2, a1["report"]["cold_saved"]), (b1, b2, b1["report"]["cold_saved"])):
        rep = second["report"]
        assert rep["rung"] == "disk" and rep["reused_tokens"] > 0 and rep["loaded_path"] == path, rep
        assert second["tokens"] == first["tokens"] and len(first["tokens"]) == GEN
    # the other model's file is at most reported as another engine's (kept)
    for second, other in ((a2, b1), (b2, a1)):
        for r in second["report"]["rejected"]:
            assert (r["path"], r["code"]) == (other["report"]["cold_saved"], "abi_mismatch"), r
    assert len(kv_files(kv)) == 2
    # ds4 kv ls names each file's model and --model keeps one model's; kv
    # prune --model removes that model's files and nothing else
    a_name, b_name = (os.path.basename(r["report"]["cold_saved"]) for r in (a1, b1))
    files = kv_cli("ls", kv)["files"]
    assert {f["name"]: f["model"] for f in files} == {a_name: model_of(abi_a), b_name: model_of(abi_b)}
    assert model_of(abi_a) == file_fingerprint(a_model) != file_fingerprint(twin) == model_of(abi_b)
    assert [f["name"] for f in kv_cli("ls", kv, "--model", twin)["files"]] == [b_name]
    assert kv_cli("prune", kv, "--model", twin, "--dry-run") == {"removed": [b_name], "errors": []}
    assert kv_files(kv) == sorted([a_name, b_name])
    assert kv_cli("prune", kv, "--model", twin) == {"removed": [b_name], "errors": []}
    assert kv_files(kv) == [a_name]
    assert run(a_model, kv)["report"]["rung"] == "disk"  # the index knows what went


def kv_cli(*args) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "ds4", "kv", *map(str, args), "--json"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_a_directory_of_the_earlier_layout_resumes_after_the_upgrade(twin, a_first, tmp_path):
    """A checkpoint under its old name (``<sha1>.kv``) and a version 2 index
    file, as today's release leaves a directory: the upgraded store rebuilds
    the index, resumes from the old file, writes no duplicate of it, and
    the other model still gets its own file beside it."""
    a_model, kv = models.model_path("smollm2"), tmp_path / "kv"
    a1 = a_first(kv, copy_ok=True)  # run(a_model, kv): its index is rewritten below
    new = a1["report"]["cold_saved"]
    old = os.path.join(kv, legacy_name(os.path.basename(new)[:40]))
    os.rename(new, old)
    index = kv / ".ds4.index"
    raw = bytearray(index.read_bytes())
    raw[8:12] = (2).to_bytes(4, "little")  # the earlier release's index version
    index.write_bytes(bytes(raw))
    a2 = run(a_model, kv)
    rep = a2["report"]
    assert rep["rung"] == "disk" and rep["loaded_path"] == old and rep["reused_tokens"] > 0, rep
    assert a2["tokens"] == a1["tokens"]
    assert kv_files(kv) == [os.path.basename(old)]  # found as stored: nothing written again
    b1 = run(twin, kv)
    assert b1["report"]["rung"] == "prefill" and b1["report"]["cold_saved"] not in (None, old)
    assert os.path.exists(old) and len(kv_files(kv)) == 2
    assert int.from_bytes(index.read_bytes()[8:12], "little") == 4  # rebuilt in today's version


def test_the_redis_tier_keeps_each_models_checkpoint(twin, tmp_path):
    """The same through the shared tier: A and B each upload their own
    checkpoint of the text (keys per ABI); with the directory emptied, each
    resumes its own from Redis (rung ``remote``) with its
    own cold run's tokens, downloaded under its own model's name."""
    node = RedisNode(str(tmp_path / "redis")).start()
    try:
        a_model, kv = models.model_path("smollm2"), tmp_path / "kv"
        remote = ("--kv-remote", node.url)
        firsts = [run(m, kv, PROMPT, *remote) for m in (a_model, twin)]
        assert all(f["report"]["rung"] == "prefill" and f["report"]["cold_saved"] for f in firsts)
        names = sorted(os.path.basename(f["report"]["cold_saved"]) for f in firsts)
        manifests = redis.Redis.from_url(node.url).keys("ds4:*:m")
        assert len(manifests) == 2, manifests  # each process uploaded its own before it exited
        shutil.rmtree(kv)
        for m, first in zip((a_model, twin), firsts, strict=True):
            again = run(m, kv, PROMPT, *remote)
            rep = again["report"]
            assert rep["rung"] == "remote" and rep["reused_tokens"] > 0, rep
            assert os.path.basename(rep["loaded_path"]) == os.path.basename(first["report"]["cold_saved"])
            assert again["tokens"] == first["tokens"]
        assert kv_files(kv) == names
    finally:
        node.stop()


def _chat(srv, msgs):
    r = srv.client().chat.completions.create(model=srv.model(), messages=msgs, max_tokens=GEN, temperature=0)
    return r.choices[0].message.content, (r.model_extra or {}).get("ds4", {})


def test_a_server_restarted_with_the_other_model_and_back_resumes_each_from_disk(twin, tmp_path):
    """``ds4 serve`` on one directory, restarted A, B, A, B (a model swap, as
    users of Ollama and LM Studio do): the second turn of each model resumes
    from its own checkpoint on disk with its own first reply."""
    kv = str(tmp_path / "kv")
    msgs = [
        # longer than the store's minimum (512 tokens): its cold save is the
        # checkpoint the same prompt resumes from after each swap
        {"role": "system", "content": "You keep the harbour log and answer from it. " * 80},
        {"role": "user", "content": "What came in with the noon tide?"},
    ]
    replies: dict[str, str] = {}
    for i, (name, model) in enumerate((("a", models.model_path("smollm2")), ("b", twin)) * 2):
        srv = Server(str(tmp_path), f"{name}{i}", "--model", model, "--kv-disk-dir", kv, engine="llamacpp", ctx=2048)
        srv.start(timeout=300)
        try:
            text, info = _chat(srv, msgs)
        finally:
            srv.stop(signal.SIGTERM)
        if name in replies:
            assert info["rung"] == "disk" and info["reused_tokens"] > 0, info
            assert text == replies[name]
        else:
            assert info["rung"] == "prefill", info
            replies[name] = text
    assert len([f for f in os.listdir(kv) if is_checkpoint_name(f)]) >= 2


def _conversation(model: str, c: int) -> list[dict]:
    """Conversation ``c`` of ``model`` ("a" or "b"): a system prompt over the
    store's minimum that carries the conversation's own marker."""
    marker = f"LEDGER-{model.upper()}{c}-{(c * 7919) % 10007:05d}"
    return [
        {"role": "system", "content": f"You keep harbour ledger {marker}. " + "Answer from the tide log. " * 90},
        {"role": "user", "content": f"Which ships are in ledger {marker}?"},
    ]


def _markers_in(text: bytes) -> set[str]:
    return {m.decode() for m in re.findall(rb"LEDGER-[AB][0-3]-\d{5}", text)}


def _files_by_model(kv) -> dict[str, tuple[str, set[str], bytes]]:
    """Every checkpoint in ``kv`` (each verified whole): its model tag, the
    markers its text holds, the text."""
    out = {}
    for f in kv_files(kv):
        ck = open_checkpoint(os.path.join(kv, f))
        out[f] = (_core.model_tag(ck.abi), _markers_in(ck.text), ck.text)
    return out


class _Pair:
    """Two ``ds4 serve`` processes, one per model ("a", "b"), and the 4
    conversations of each, which grow with each turn's reply."""

    def __init__(self, tmp_path, paths: dict[str, str]):
        self.tmp, self.paths = str(tmp_path), paths
        self.convs = {(m, c): _conversation(m, c) for m in "ab" for c in range(4)}

    def start(self, tag: str, kv_dir: str | None) -> dict[str, Server]:
        servers = {}
        for m in "ab":
            extra = ("--kv-disk-dir", kv_dir) if kv_dir else ()
            servers[m] = Server(self.tmp, f"{m}-{tag}", "--model", self.paths[m], *extra, engine="llamacpp", ctx=2048)
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.start(timeout=300), servers.values()))
        return servers

    @staticmethod
    def stop(servers):
        # every one stopped before any is judged: none left running
        codes = {m: s.stop(signal.SIGTERM) for m, s in servers.items()}
        for m, rc in codes.items():
            # uvicorn re-raises the signal once it has shut down gracefully
            assert rc in (0, -signal.SIGTERM), servers[m].text_log()[-2000:]

    def turns(self, tag: str, kv_dir: str, first: int, count: int) -> list[dict]:
        """``count`` turns of every conversation on a fresh pair of servers,
        A's and B's turn of each conversation sent together; each reply is
        appended with the next user message."""
        servers, out = self.start(tag, kv_dir), []
        try:
            for n in range(first, first + count):
                got = {}
                with ThreadPoolExecutor(2) as ex:
                    for c in range(4):
                        futs = {m: ex.submit(_chat, servers[m], self.convs[m, c]) for m in "ab"}
                        got.update({(m, c): f.result() for m, f in futs.items()})
                for key, (text, _info) in got.items():
                    self.convs[key] += [
                        {"role": "assistant", "content": text},
                        {"role": "user", "content": f"And at tide {n + 1}?"},
                    ]
                out.append(got)
        finally:
            self.stop(servers)
        return out


def _check_loads(kv, pair: _Pair, got: dict, tags: dict[str, str]) -> None:
    """Every turn of ``got`` resumed from disk, from a file of its own model
    (``tags``) that holds its own conversation only."""
    files = _files_by_model(kv)
    for key, (_t, info) in got.items():
        assert info["rung"] == "disk" and info["reused_tokens"] > 0, (key, info)
        tag, marks, _text = files[info["loaded_path"]]
        assert tag == tags[key[0]], (key, info)
        assert marks == _markers_in(pair.convs[key][0]["content"].encode()), (key, marks)


def test_two_servers_of_two_models_on_one_directory_interleave_restart_and_resume(twin, tmp_path):
    """Two ``ds4 serve`` processes, one per model, on one directory at once:
    4 conversations each, their turns sent to both servers together (one live
    session each, so every turn after a conversation's first resumes from its
    own checkpoint on disk). Both are restarted: every conversation's next
    turn resumes from disk with a cold prefill's reply, no file written
    before the restart is lost, and each file and each load holds its own
    model's conversation only (the markers planted in each)."""
    kv = str(tmp_path / "kv")
    pair = _Pair(tmp_path, {"a": models.model_path("smollm2"), "b": twin})
    first, second = pair.turns("1", kv, 1, 2)
    # nothing stored yet: a cold prefill (or a rewind to the template's
    # first tokens, which the last conversation shares)
    assert all(info["rung"] != "disk" and info["reused_tokens"] < 16 for _t, info in first.values()), first
    files = _files_by_model(kv)
    tags = {m: files[second[m, 0][1]["loaded_path"]][0] for m in "ab"}
    assert len(set(tags.values())) == 2 and {t for t, _m, _x in files.values()} == set(tags.values())
    _check_loads(kv, pair, second, tags)
    for f, (tag, marks, _text) in files.items():
        # one conversation per file, of the model whose tag names it
        assert len(marks) == 1 and tags[next(iter(marks))[7].lower()] == tag, (f, marks)

    (third,) = pair.turns("2", kv, 3, 1)
    _check_loads(kv, pair, third, tags)
    # no file lost: each one written before the restart is still there, or
    # was superseded by its own model's later checkpoint of its conversation
    after = _files_by_model(kv)
    for f in set(files) - set(after):
        tag, marks, text = files[f]
        assert any(t == tag and m == marks and x.startswith(text) for t, m, x in after.values()), f

    # a cold prefill of each turn's whole prompt, on servers with no store
    # (one conversation after another, so nothing but the template's first
    # tokens is shared with the live state)
    cold = pair.start("cold", None)
    try:
        for n, got in ((2, second), (3, third)):
            for key, msgs in pair.convs.items():
                # turn n's prompt: the system prompt and n user messages
                text, info = _chat(cold[key[0]], msgs[: 2 * n])
                assert info["rung"] != "disk" and info["reused_tokens"] < 16, (key, info)
                assert got[key][0] == text, (key, n, info)
    finally:
        pair.stop(cold)
