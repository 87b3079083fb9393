"""Real processes killed mid-write: a checkpoint either exists whole and
verifies, or does not exist; the old file survives a killed rewrite; temp
files of dead writers are cleaned by the next store that opens the
directory."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import ds4
from ds4.errors import CheckpointError

WRITER = r"""
import os, sys, time
import numpy as np
import ds4
d, seed = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(seed)
text = ("conversation %d " % seed) * 50
name = ds4._core.sha1_hex(text.encode()) + ".kv"
arrays = {f"t{i}": rng.standard_normal(4 * 1024 * 1024 // 4).astype(np.float32) for i in range(8)}  # 32 MiB
print("ready", flush=True)
while True:
    ds4.write_checkpoint(os.path.join(d, name), text, arrays, abi="crash/1", tokens=100, ctx=1000)
"""


TRIALS = 8


def _kill_one_writer(d, trial):
    """Start a writer, kill it with SIGKILL, return whether a temp file was
    caught (present after the kill: the writer died mid-write). Even trials
    wait until a temp file appears, then kill within a few ms (aimed at the
    write); odd trials kill at a random time (anywhere in the write loop)."""
    rnd = random.Random(trial)
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(trial)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        if trial % 2 == 0:
            deadline = time.monotonic() + 30
            while not any(".tmp." in f for f in os.listdir(d)) and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rnd.uniform(0, 0.005))
        else:
            time.sleep(rnd.uniform(0.05, 1.5))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    return any(".tmp." in f for f in os.listdir(d))


def test_writer_killed_mid_write(tmp_path):
    caught = 0
    for trial in range(TRIALS):
        d = tmp_path / f"trial{trial}"
        d.mkdir()
        caught += _kill_one_writer(d, trial)
        files = os.listdir(d)
        finals = [f for f in files if f.endswith(".kv")]
        # at most one final file, and if present it verifies completely
        assert len(finals) <= 1, (trial, files)
        for f in finals:
            ck = ds4.open_checkpoint(d / f, expected_abi="crash/1")
            assert ck.tokens == 100 and len(ck.arrays()) == 8
            del ck
        # the next store to open the directory removes the dead writer's temp file
        ds4.KVStore(d)
        assert [f for f in os.listdir(d) if ".tmp." in f] == [], trial
        assert sorted(f for f in os.listdir(d) if f.endswith(".kv")) == finals, trial
    # Without this, every kill could miss the write (between two writes, or
    # before the first) and the checks above would pass trivially.
    assert caught > 0, f"no kill caught a writer mid-write in {TRIALS} trials"


def test_reader_holding_a_map_survives_replacement_and_eviction(tmp_path):
    """A reader's zero-copy arrays stay valid while another process replaces
    or deletes the file (rename/unlink never touch mapped pages)."""
    import numpy as np

    text = "held open " * 20
    path = tmp_path / (ds4._core.sha1_hex(text.encode()) + ".kv")
    a = np.arange(1 << 20, dtype=np.float32)
    ds4.write_checkpoint(path, text, {"a": a}, abi="x/1", tokens=5, ctx=10)
    ck = ds4.open_checkpoint(path)
    view = ck.array("a")
    ds4.write_checkpoint(path, text, {"a": a * 2}, abi="x/1", tokens=5, ctx=10)  # replaced
    assert np.array_equal(view, a)
    os.unlink(path)
    del ck
    assert np.array_equal(view, a)


def test_torn_file_at_every_size_is_rejected(tmp_path):
    """What a crash without rename could leave (a prefix of the file under
    the final name): every prefix is rejected with a CheckpointError."""
    import numpy as np

    text = "torn " * 30
    name = ds4._core.sha1_hex(text.encode()) + ".kv"
    src = tmp_path / "src" / name
    src.parent.mkdir()
    ds4.write_checkpoint(src, text, {"a": np.ones(300, np.float32), "b": b"blob"}, abi="x/1", tokens=5, ctx=10)
    data = src.read_bytes()
    dst = tmp_path / name
    for n in range(len(data)):
        dst.write_bytes(data[:n])
        with pytest.raises(CheckpointError):
            ds4.open_checkpoint(dst)
    # a zero-filled tail of the right length (torn write of the last pages)
    dst.write_bytes(data[: len(data) - 1000] + b"\0" * 1000)
    with pytest.raises(CheckpointError):
        ds4.open_checkpoint(dst)


SIGBUS_CHILD = r"""
import os, sys, threading
import numpy as np
import ds4
from ds4.errors import TruncatedCheckpointError
path = sys.argv[1]
ck = ds4.open_checkpoint(path)            # verified, mapped
a = ck.array("a")
# (below) a session loading a file truncated mid-load ends invalid with a
# typed error: its file is written and opened (mapped) here, so that both
# truncations run at once: each waits out its map's read lease
# (/proc/sys/fs/lease-break-time, 45 s by default), one wait for the two
eng = ds4.ReferenceEngine()
sess = ds4.Session(eng, ctx=512)
sess.sync(eng.tokenize("x" * 40, special=True))
p2 = os.path.join(sys.argv[2], ds4._core.sha1_hex(sess.text_bytes()) + ".kv")
ds4.write_checkpoint(p2, sess.text_bytes(), sess.export_arrays(), abi=sess.payload_abi, tokens=sess.n_past, ctx=512)
ck2 = ds4.open_checkpoint(p2)
t2 = threading.Thread(target=os.truncate, args=(p2, 100))
t2.start()
os.truncate(path, 4096)                    # another process truncates it in place
t2.join()
s = float(a.sum())                         # touches vanished pages: SIGBUS without the guard
try:
    ck.check_intact()
    print("intact?!")
except TruncatedCheckpointError as e:
    print("truncated", e.code, s == 0.0 or s != float(np.arange(a.size, dtype=np.float32).sum()))
# the session's load of the truncated p2
assert os.path.getsize(p2) == 100
s2 = ds4.Session(eng, ctx=512)
try:
    s2.load_checkpoint(ck2)
    print("loaded?!")
except TruncatedCheckpointError:
    print("session", s2.checkpoint_valid)
"""


def test_file_truncated_while_mapped_does_not_kill_the_process(tmp_path):
    import numpy as np

    text = "mapped then truncated " * 5
    path = tmp_path / (ds4._core.sha1_hex(text.encode()) + ".kv")
    ds4.write_checkpoint(path, text, {"a": np.arange(1 << 20, dtype=np.float32)}, abi="x/1", tokens=5, ctx=10)
    r = subprocess.run(
        [sys.executable, "-c", SIGBUS_CHILD, str(path), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    lines = r.stdout.split("\n")
    assert lines[0] == "truncated truncated True", r.stdout
    assert lines[1] == "session False", r.stdout
