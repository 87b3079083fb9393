"""Issue 13, item 6: verification streams in bounded memory, whatever the
file claims. A sparse file whose header (correctly signed) declares a 2 GiB
payload is verified, mapped or copied, in a child process whose peak RSS
(``VmHWM``) grows by less than 64 MiB; before, the copy mode allocated the
whole claimed payload (2.1 GB) before its checksum could fail."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_core_format import patch

MARK = 12345  # a length no other u64 of the small file holds
CLAIM = 2 << 30
LIMIT = 64 << 20

CHILD = r"""
import json, sys
import ds4
from ds4.errors import CheckpointError

def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")

path, small, mode = sys.argv[1:4]
kw = {"mmap": mode == "map"}
ds4.open_checkpoint(small, **kw).arrays()  # warm up: every import and first-use allocation
before = hwm()
try:
    if mode == "verify":
        from ds4.cli.kvinfo import inspect_file
        out = inspect_file(path, full=True)["status"]
    else:
        ds4.open_checkpoint(path, **kw)
        out = "loaded"
except CheckpointError as e:
    out = e.code
print(json.dumps({"grew": hwm() - before, "out": out}))
"""


@pytest.fixture(scope="module")
def sparse(tmp_path_factory, write_ck):
    d = tmp_path_factory.mktemp("sparse")
    p = write_ck(d, b"a sparse checkpoint", {"big": np.zeros(MARK, np.uint8)})
    raw = Path(p).read_bytes()
    at = raw.index(struct.pack("<Q", MARK))
    while at >= 0:
        patch(p, at, struct.pack("<Q", CLAIM))
        raw = Path(p).read_bytes()
        at = raw.find(struct.pack("<Q", MARK))
    po = raw.index(b"a sparse checkpoint") + len(b"a sparse checkpoint")
    po = (po + 63) // 64 * 64
    os.truncate(p, po + CLAIM)  # the rest is a hole: no disk, zeros when read
    small = write_ck(d, b"a small checkpoint", {"x": np.arange(10, dtype=np.float32)})
    return p, small


@pytest.mark.parametrize("mode", ["map", "copy", "verify"])
def test_a_sparse_2gib_file_is_verified_in_bounded_memory(sparse, mode):
    p, small = sparse
    assert os.path.getsize(p) > CLAIM and os.stat(p).st_blocks * 512 < (1 << 20)  # sparse
    r = subprocess.run([sys.executable, "-c", CHILD, p, small, mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # the header is honest about its size, the payload is a lie: its checksum fails
    assert got["out"] in ("payload_checksum", "corrupt"), got
    assert got["grew"] < LIMIT, f"peak RSS grew by {got['grew'] / 2**20:.1f} MiB verifying a 2 GiB claim ({mode})"
