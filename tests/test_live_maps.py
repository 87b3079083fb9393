"""Issue 13, item 5: the SIGBUS guard with more live maps than it has slots.

1,100 checkpoints stay open with a numpy view each: the guard has 1,024
slots, so some payloads must be copies; none is mapped unguarded, every
view reads the right bytes, and every view can check itself. A file cut
under a live map is then read through its view: the process lives, and the
view says what happened."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import ds4

CHILD = r"""
import os, sys
import numpy as np
import ds4
from ds4.errors import TruncatedCheckpointError
d = sys.argv[1]
want = np.arange(4096, dtype=np.float32)
paths = []
for i in range(4):
    p = os.path.join(d, ds4._core.sha1_hex(b"cut %d" % i) + ".kv")
    ds4.write_checkpoint(p, b"cut %d" % i, {"a": want}, abi="t/1", tokens=1, ctx=8)
    paths.append(p)
live = []
for i in range(1100):
    ck = ds4.open_checkpoint(paths[i % 4])
    ck.release()  # as a load does at its end
    live.append((ck, ck.tensor_buffer("a")))
mapped = [v for _, v in live if v.mapped]
print("mapped", len(mapped), "copies", len(live) - len(mapped))
assert all(np.array_equal(np.frombuffer(v, np.float32), want) for _, v in live)
for ck, v in live:
    v.check_intact()
    ck.check_intact()
# cut the file under a mapped view, then read every page of it
victim = next((ck, v) for ck, v in live if v.mapped)
os.truncate(victim[0].path, 100)
a = np.frombuffer(victim[1], np.float32)
print("sum after cut", float(a.sum()))
try:
    victim[1].check_intact()
    print("view: intact?!")
except TruncatedCheckpointError as e:
    print("view:", e.code)
copy = next(v for _, v in live if not v.mapped)
copy.check_intact()
print("copy: intact", bool(np.array_equal(np.frombuffer(copy, np.float32), want)))
"""


def test_1100_live_maps_guarded_or_copied_and_views_check_themselves(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    mapped, copies = int(lines[0].split()[1]), int(lines[0].split()[3])
    assert mapped + copies == 1100
    assert 0 < mapped <= 1024 and copies >= 1100 - 1024, lines[0]
    assert lines[2] == "view: truncated", lines
    assert lines[3] == "copy: intact True", lines


def test_a_view_of_a_copy_is_always_intact(tmp_path, write_ck):
    p = write_ck(tmp_path, b"copied", {"a": np.arange(8, dtype=np.int32)})
    ck = ds4.open_checkpoint(p, mmap=False)
    v = ck.tensor_buffer("a")
    assert not v.mapped and not ck.leased
    v.check_intact()
    assert np.array_equal(np.frombuffer(v, np.int32), np.arange(8))
