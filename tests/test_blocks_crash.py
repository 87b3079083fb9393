"""Shared blocks (``ds4.kvstore.blocks``) under ``kill -9``: a writer killed
during a block write, between its blocks and its manifest, or just before
the manifest's rename leaves no state that loads wrong (every manifest the
lookup offers loads whole and equals a cold prefill of its text; the one
being written does not exist), and what it left is reclaimed: the next
store to open the directory removes the dead writer's temp files (a
block's as a checkpoint's), the next eviction the blocks no manifest names.

Two kinds of kills: real writers (the reference engine, deterministic)
saving a conversation in a loop, SIGKILLed at random moments (forked from
one helper process that has ds4 imported, so each kill costs no start-up);
and writers that kill themselves at a chosen point (a patched
``_core.write_block`` / ``_core.write_checkpoint`` / ``save.stat_key``)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.kv import prefilled, toks
from helpers.procs import dead_pid

import ds4
from ds4 import _core
from ds4.kvstore.blocks import BLOCKS_DIR, MANIFEST_FLAG, TABLE_TENSOR
from ds4.kvstore.files import INDEX_TMP_NAME, TMP_MAX_AGE_S, pid_space

B = 8  # tokens per block: many blocks (and many block writes) per save
MIN_TOKENS = 8
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
#: one thread per process: the helper forks its writers (no BLAS pool to inherit)
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


SYSTEM = "system: " + _words(40, seed=1)  # every conversation's shared head (its blocks shared)


def _conversation(k: int, j: int) -> str:
    return f"{SYSTEM} task {k}.{j}: " + _words(70, seed=1000 * k + j)


def _store(d, **kw) -> ds4.KVStore:
    kw.setdefault("budget_mb", 1024)
    return ds4.KVStore(str(d), blocks=True, block_tokens=B, min_tokens=MIN_TOKENS, frontier_tokens=0, **kw)


# -- what the directory holds ----------------------------------------------------
def _block_files(d) -> set[str]:
    bd = os.path.join(d, BLOCKS_DIR)
    if not os.path.isdir(bd):
        return set()
    return {f[: -len(".kvb")] for f in os.listdir(bd) if f.endswith(".kvb") and not f.startswith(".")}


def _temp_files(d) -> list[str]:
    """Writers' temp files left in the store's directory and in ``blocks/``
    (the index's own temp file is no writer's: the next index write truncates it)."""
    out = [f for f in os.listdir(d) if ".tmp." in f]
    bd = os.path.join(d, BLOCKS_DIR)
    if os.path.isdir(bd):
        out += [f"{BLOCKS_DIR}/{f}" for f in os.listdir(bd) if ".tmp." in f]
    return sorted(f for f in out if f != INDEX_TMP_NAME)


def _manifests(d) -> dict[str, tuple[str, set[str]]]:
    """Each checkpoint file: its key text, and the blocks its table names
    (read here from the file, not from the store's bookkeeping)."""
    out = {}
    for f in os.listdir(d):
        if not f.endswith(".kv") or f.startswith("."):
            continue
        ck = ds4.open_checkpoint(os.path.join(d, f), check_name=False)
        named: set[str] = set()
        if ck.flags & MANIFEST_FLAG:
            _, records = _core.read_block_table(ck.array(TABLE_TENSOR))
            named = {r[0].hex() for r in records}
        out[f] = (bytes(ck.text).decode(), named)
        del ck
    return out


# -- loads -------------------------------------------------------------------------
class Cold:
    """Cold prefills of texts (each computed once): a loaded state must
    equal one in its tokens, logits and every array of its state, and (when
    asked: it costs a decode) in its greedy continuation."""

    def __init__(self, eng):
        self.eng = eng
        self._got: dict[str, tuple[dict[str, np.ndarray], list[int]]] = {}

    def check(self, sess: ds4.Session, text: str, continuation: bool = True) -> None:
        if text not in self._got:
            c = prefilled(self.eng, text)
            self._got[text] = ({k: np.array(a) for k, a in c.export_arrays().items()}, list(c.generate(12)))
        arrays, cont = self._got[text]
        assert list(sess.tokens) == arrays["tokens"].tolist()
        assert np.array_equal(sess.logits, arrays["logits"])
        got = sess.export_arrays()
        assert got.keys() == arrays.keys()
        for k, a in arrays.items():
            assert got[k].dtype == a.dtype and np.array_equal(got[k], a), k
        if continuation:
            assert list(sess.generate(12)) == cont


def _resume(store: ds4.KVStore, eng, text: str) -> tuple[ds4.Session, ds4.RecoveryReport]:
    s = ds4.Session(eng, ctx=4096)
    return s, ds4.recover(s, store, text, evict_save=False)


def _loads_whole(store: ds4.KVStore, eng, cold: Cold, text: str, continuation: bool = True) -> None:
    """The manifest of ``text`` loads with every block, nothing refused,
    and the state equals a cold prefill of ``text``."""
    s, rep = _resume(store, eng, text)
    assert rep.rung == "disk" and rep.reused_tokens == len(toks(eng, text)), (rep.rung, rep.reused_tokens)
    assert not rep.rejected, [(r.stage, r.code, r.reason) for r in rep.rejected]
    cold.check(s, text, continuation)


def _gc(d, store: ds4.KVStore) -> set[str]:
    """An eviction pass within the budget: it removes only what no manifest
    names. Returns the orphans it removed; asserts nothing named went."""
    named = set().union(*(b for _, b in _manifests(d).values()))
    before = _block_files(d)
    assert named <= before, f"manifests name missing blocks: {sorted(named - before)[:3]}"
    assert store.evict() == 0  # within the budget: no manifest goes
    after = _block_files(d)
    assert after == named, f"orphans kept: {sorted(after - named)[:3]}"
    assert _temp_files(d) == []
    return before - after


# -- writers SIGKILLed at random moments -----------------------------------------------
HELPER = r"""
import json, os, sys, time, traceback
import numpy as np
import ds4
d, B, min_tokens, budget_mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
eng = ds4.ReferenceEngine()

def write(seed, texts):
    store = ds4.KVStore(d, budget_mb, blocks=True, block_tokens=B, min_tokens=min_tokens, frontier_tokens=0)
    rng = np.random.default_rng(seed)
    for text in texts:
        ids = eng.tokenize(text, special=True)
        sess = ds4.Session(eng, ctx=4096)
        cut = int(rng.integers(min_tokens, 80))
        while cut < len(ids):
            cut = min(len(ids), cut + int(rng.integers(24, 129)))
            sess.sync(ids[:cut])
            got = store.store_live_checked(sess, "continued")
            if not isinstance(got, str):
                raise AssertionError(f"save declined: {got}")
            print("saved", flush=True)
    print("done", flush=True)
    while True:  # never exits on its own: its pid stays its own until it is killed
        time.sleep(1)

print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            write(job["seed"], job["texts"])
        except BaseException:
            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        os._exit(code)
    print(pid, flush=True)
    print("status", os.waitpid(pid, 0)[1], flush=True)
"""

KILLS = 30


def test_writers_killed_at_random_never_load_wrong_and_leave_nothing_after_gc(eng, tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    cold = Cold(eng)
    rnd = random.Random(1234)
    # a budget of a few conversations: the writers' own evictions run (and are killed) too
    helper = subprocess.Popen(
        [sys.executable, "-c", HELPER, str(d), str(B), str(MIN_TOKENS), "1.5"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **ONE_THREAD},
    )
    assert helper.stdin is not None and helper.stdout is not None
    verified: set[tuple[object, ...]] = set()
    orphaned = finished = caught = 0
    try:
        assert helper.stdout.readline().strip() == "ready"
        for k in range(KILLS):
            texts = [_conversation(k, j) for j in range(3)]
            helper.stdin.write(json.dumps({"seed": k, "texts": texts}) + "\n")
            helper.stdin.flush()
            pid = int(helper.stdout.readline())
            # let it commit 0-2 saves (a pace the machine's speed does not change), then kill it at a
            # random moment of what follows: a block write, the manifest's, an eviction, a prefill
            for _ in range(rnd.randrange(3)):
                assert helper.stdout.readline() in ("saved\n", "done\n")
            time.sleep(rnd.uniform(0, 0.25))
            os.kill(pid, signal.SIGKILL)  # alive until killed (it never exits on its own): its pid is its own
            line = helper.stdout.readline()
            while line in ("saved\n", "done\n"):
                finished += line == "done\n"
                line = helper.stdout.readline()
            assert line.startswith("status "), line
            status = int(line.split()[1])  # reaped by the helper: its pid is no process now
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, "see its stderr")

            caught += any(".kvb.tmp." in f for f in _temp_files(d))  # killed mid block write
            store = _store(d)  # a new process's store: it lists the directory, dropping dead writers' temp files
            assert _temp_files(d) == [], k
            for e in store.entries():  # every checkpoint the lookup offers loads whole and equals cold
                key = (e.name, *e.stat_key[:2])  # inode, size (a load touches its mtime); a rewrite is checked again
                if key in verified:
                    continue
                text = bytes(ds4.open_checkpoint(e.path, load_payload=False).text).decode()
                _loads_whole(store, eng, cold, text, continuation=False)  # its whole state compared
                verified.add(key)
            # the longest prompt: its longest stored prefix loads, the rest is prefilled, equal to cold
            s, rep = _resume(store, eng, texts[0])
            assert not rep.rejected, [(r.stage, r.code) for r in rep.rejected]
            cold.check(s, texts[0])
            orphaned += bool(_gc(str(d), store))
    finally:
        helper.stdin.close()
        helper.wait(timeout=30)
        helper.stdout.close()
    assert helper.returncode == 0
    print(f"kills {KILLS}, idle {finished}, orphaned {orphaned}, mid-block {caught}, checked {len(verified)}")
    # without this, every kill could have missed the window between a save's blocks and its manifest
    assert orphaned > 0, f"no kill of {KILLS} left an orphaned block"
    # at the end: a new store; every manifest loads whole; nothing unnamed
    store = _store(d)
    for text, _ in _manifests(str(d)).values():
        _loads_whole(store, eng, cold, text)
    assert _gc(str(d), store) == set()


# -- writers killed at a chosen point -------------------------------------------------------
KILLER = r"""
import os, signal, sys, time
import ds4
from ds4 import _core
import ds4.kvstore.save as save
from ds4.kvstore.files import pid_space
d, mode, B, min_tokens, first, second = sys.argv[1:7]
eng = ds4.ReferenceEngine()
store = ds4.KVStore(d, blocks=True, block_tokens=int(B), min_tokens=int(min_tokens), frontier_tokens=0)
sess = ds4.Session(eng, ctx=4096)
sess.sync(eng.tokenize(first, special=True))
assert isinstance(store.store_live_checked(sess, "continued"), str)  # committed

def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)

def temp_name(final):  # as the core's writer names its temp files (rust/format/writer.rs, temp_name)
    return f".{final}.tmp.{os.getpid()}.{pid_space()}.{time.time_ns():x}0"

real_block, real_checkpoint, real_stat_key = _core.write_block, _core.write_checkpoint, save.stat_key
scratch = os.path.join(os.path.dirname(d), "scratch")
os.makedirs(scratch, exist_ok=True)
calls = []

def write_block(dir, name, n_tokens, abi, payload, auth_key=None):
    calls.append(name)
    if len(calls) == 3 and mode == "between_blocks":
        die()
    if len(calls) == 3 and mode == "mid_block":  # the first half of the block's file in its temp file
        real_block(scratch, name, n_tokens, abi, payload, auth_key)
        with open(os.path.join(scratch, name.hex() + ".kvb"), "rb") as f:
            data = f.read()
        with open(os.path.join(dir, temp_name(name.hex() + ".kvb")), "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        die()
    return real_block(dir, name, n_tokens, abi, payload, auth_key)

def write_checkpoint(path, *args, **kw):
    if mode == "before_manifest":  # every block written and the directory synced; no manifest yet
        die()
    if mode == "before_rename":  # the whole manifest fsynced in its temp file, not renamed
        name = os.path.basename(path)
        got = real_checkpoint(os.path.join(scratch, name), *args, **kw)
        os.rename(os.path.join(scratch, name), os.path.join(d, temp_name(name)))
        print("manifest", got[0], flush=True)
        die()
    return real_checkpoint(path, *args, **kw)

def stat_key(st):  # after the rename: the manifest is committed, the index not yet told
    die()

_core.write_block, _core.write_checkpoint, save.stat_key = write_block, write_checkpoint, stat_key
sess.sync(eng.tokenize(second, special=True))
print("saving", flush=True)
store.store_live_checked(sess, "continued")
print("not killed", flush=True)
"""

MODES = ["between_blocks", "mid_block", "before_manifest", "before_rename", "after_rename"]


@pytest.mark.parametrize("mode", MODES)
def test_a_writer_killed_at_a_chosen_point(eng, tmp_path, mode):
    d = tmp_path / "kv"
    d.mkdir()
    first = _conversation(0, 0)
    second = first + " then " + _words(60, seed=77)  # a continuation: its own new blocks after first's
    r = subprocess.run(
        [sys.executable, "-c", KILLER, str(d), mode, str(B), str(MIN_TOKENS), first, second],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "saving" in r.stdout and "not killed" not in r.stdout
    committed = mode == "after_rename"

    # what the kill left, before any store looks at the directory
    on_disk = _manifests(str(d))
    texts = sorted(t for t, _ in on_disk.values())
    assert texts == (sorted([first, second]) if committed else [first])
    named = set().union(*(b for _, b in on_disk.values()))
    orphans = _block_files(d) - named
    new_blocks = len(toks(eng, second)) // B - len(toks(eng, first)) // B
    assert len(orphans) == {"between_blocks": 2, "mid_block": 2}.get(mode, 0 if committed else new_blocks)
    left = _temp_files(d)
    if mode == "mid_block":
        assert len(left) == 1 and left[0].startswith(f"{BLOCKS_DIR}/.") and ".kvb.tmp." in left[0]
    elif mode == "before_rename":
        assert len(left) == 1 and not left[0].startswith(BLOCKS_DIR) and ".kv.tmp." in left[0]
    else:
        assert left == []

    # a new process's store: the dead writer's temp files go when it opens the directory
    store = _store(d)
    assert _temp_files(d) == [], "a dead writer's temp file survived the store's opening"
    cold = Cold(eng)
    _loads_whole(store, eng, cold, first)
    s, rep = _resume(store, eng, second)  # the save being written: absent, unless it was committed
    assert not rep.rejected
    assert rep.rung == "disk" and rep.reused_tokens == len(toks(eng, second if committed else first))
    cold.check(s, second)

    # the next eviction (within the budget) removes exactly the orphans
    assert _gc(str(d), store) == orphans
    _loads_whole(_store(d), eng, cold, first)

    # the save done again: written whole, and it loads
    again = _store(d)
    assert isinstance(again.store_live_checked(prefilled(eng, second), "continued"), str)
    _loads_whole(_store(d), eng, cold, second)
    _loads_whole(_store(d), eng, cold, first)
    assert _gc(str(d), _store(d)) == set()


# -- the temp files of block writers ----------------------------------------------------------
def test_a_block_temp_file_goes_when_its_writer_is_gone_and_not_before(tmp_path):
    """A block's temp file (the core's name for it) is a writer's like a
    checkpoint's: a dead writer of this PID namespace's goes when a store
    opens the directory; a live writer's stays; another namespace's (its pid
    means nothing here) stays until it is older than TMP_MAX_AGE_S."""
    d = tmp_path / "kv"
    bd = d / BLOCKS_DIR
    bd.mkdir(parents=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = dead_pid()
    try:
        here = pid_space()

        def temp(pid: int, space: str, age: float = 0) -> str:
            name = f".{os.urandom(32).hex()}.kvb.tmp.{pid}.{space}.{time.time_ns():x}0"
            (bd / name).write_bytes(b"half a block")
            t = time.time() - age
            os.utime(bd / name, (t, t))
            return name

        gone = [temp(dead, here), temp(live.pid, "0" * 12 + "1", age=TMP_MAX_AGE_S + 60)]
        kept = [temp(live.pid, here), temp(os.getpid(), here), temp(dead, "0" * 12 + "1"), temp(dead, "x")]
        assert set(gone) | set(kept) == set(os.listdir(bd))
        _store(d)
        assert sorted(os.listdir(bd)) == sorted(kept)
        live.kill()
        live.wait()
        _store(d)  # its writer gone now
        assert sorted(os.listdir(bd)) == sorted(kept[1:])
    finally:
        live.kill()
        live.wait()
