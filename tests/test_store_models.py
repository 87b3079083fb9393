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
import subprocess
import sys

import models
import pytest
from cknames import stored_name

from ds4 import _core
from ds4.checkpoint import open_checkpoint
from ds4.kvstore import is_checkpoint_name
from ds4.kvstore.files import legacy_name

#: a raw prompt of about 650 SmolLM2 tokens
PROMPT = " ".join(
    f"Line {i}: the harbour master logs ship {i * 7 % 13} at the tide of hour {i % 24}." for i in range(40)
)
GEN = 40


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    return models.twin_model(str(tmp_path_factory.mktemp("twin")))


def run(model: str, kv, prompt: str = PROMPT) -> dict:
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
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def kv_files(kv) -> list[str]:
    return sorted(f for f in os.listdir(kv) if is_checkpoint_name(f))


def test_two_models_keep_and_resume_their_own_checkpoint_of_one_text(twin, tmp_path):
    """A, B, A, B on one directory, each a new process: each model's cold run
    saves its own file (B's is not refused for A's name), each second run
    resumes from its own file from disk with its own cold run's tokens, and
    neither loads the other's."""
    a_model, kv = models.model_path("smollm2"), tmp_path / "kv"
    abi_a, abi_b = models.engine("smollm2").payload_abi(), None
    a1 = run(a_model, kv)
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


def test_a_directory_of_the_earlier_layout_resumes_after_the_upgrade(twin, tmp_path):
    """A checkpoint under its old name (``<sha1>.kv``) and a version 2 index
    file, as today's release leaves a directory: the upgraded store rebuilds
    the index, resumes from the old file, writes no duplicate of it, and
    the other model still gets its own file beside it."""
    a_model, kv = models.model_path("smollm2"), tmp_path / "kv"
    a1 = run(a_model, kv)
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
    assert int.from_bytes(index.read_bytes()[8:12], "little") == 3  # rebuilt in today's version
