"""v3 decoding in bounded memory (docs/FORMAT.md §1.10, "What a reader
holds"): hostile compressed checkpoints, each opened in a child process
whose peak resident memory (``VmHWM``) is read before and after the open.

* a 16 MiB sparse v3 file (its payload a hole) declaring 1 GiB of raw bytes;
* an 8 KiB-on-disk file declaring 2 GiB;
* a keyed 1 GiB sparse file;
* a forged (declared raw size) file through the shared Redis tier, with and
  without a key.

Each is refused with a typed error (the engine's state bound: ``frame_table``,
corrupt, before anything is allocated; without a bound, the first frame or
the MAC), and the child's peak grows by less than the legitimate state plus
one frame plus :data:`SLACK` (interpreter noise). A valid v3 file of 64 MiB
still loads byte-exact, its peak about its raw size (not raw + stored, what
a copy of the stored payload cost).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xxhash

import ds4
from ds4 import _core
from ds4.checkpoint import _tensor_entry, open_checkpoint
from ds4.engine import state_bound

MiB = 1 << 20
SLACK = 16 * MiB  # interpreter noise in the child
FRAME = MiB  # the span ds4 writes
CTX = 2048
TOKENS = 40
KEY_SECRET = b"a v3 bounds test secret, not for use"

_NOISE = np.random.default_rng(7).integers(0, 256, MiB, dtype=np.uint8)


def _text(tag: str) -> bytes:
    return (" ".join(f"{tag}-{i}" for i in range(TOKENS)) + " end.").encode()


def write_v3(directory, tag: str, noise_mib: int, zero_mib: int, *, key: bytes | None = None, span: int = FRAME) -> str:
    """A v3 checkpoint of the reference engine's ABI and ``TOKENS`` tokens
    whose payload is ``noise_mib`` MiB of noise then ``zero_mib`` MiB of
    zeros (views of one noise block, one zero tensor: nothing of that size
    is held here), in frames of ``span`` raw bytes. Its path."""
    text = _text(tag)
    arrays = {f"n{i}": _NOISE for i in range(noise_mib)}
    if zero_mib:  # one tensor: its pages never touched (read as the zero page)
        arrays["z"] = np.zeros(zero_mib * MiB, dtype=np.uint8)
    path = os.path.join(os.fspath(directory), hashlib.sha1(text).hexdigest() + ".kv")
    abi = ds4.ReferenceEngine().payload_abi()
    _core.write_checkpoint(
        path,
        text,
        [_tensor_entry(n, a) for n, a in arrays.items()],
        abi=abi,
        tokens=TOKENS,
        ctx=CTX,
        auth_key=key,
        drop_cache=False,
        codec="zstd",
        filter="none",
        span=span,
    )
    assert open_checkpoint(path, load_payload=False).version == 3
    return path


def hollow(path: str) -> None:
    """The payload of ``path`` made a hole (the file keeps its length; a
    sparse file reads zeros there), its payload checksum and header
    checksum resealed over the zeros (so only a frame, or the MAC, can
    tell)."""
    ck = open_checkpoint(path, load_payload=False)
    off, n, size = ck.payload_offset, ck.payload_bytes, ck.file_size
    with open(path, "r+b") as f:
        head = bytearray(f.read(off))
        f.seek(off + n)
        trailer = f.read()
        f.truncate(off)
        f.truncate(size)
        f.seek(off + n)
        f.write(trailer)
    h = xxhash.xxh3_64(seed=0)
    zeros = bytes(MiB)
    for at in range(0, n, MiB):
        h.update(zeros[: min(MiB, n - at)])
    head[80:88] = h.intdigest().to_bytes(8, "little")
    meta = int.from_bytes(head[20:24], "little")
    fixed = bytearray(head[:96])
    fixed[12:16] = bytes(4)
    fixed[32:40] = bytes(8)
    fixed[88:96] = bytes(8)
    head[88:96] = xxhash.xxh3_64_intdigest(bytes(fixed) + bytes(head[96 : 96 + meta])).to_bytes(8, "little")
    with open(path, "r+b") as f:
        f.write(head[:96])
    assert os.stat(path).st_blocks * 512 < 4 * MiB, "the payload is a hole"


CHILD = textwrap.dedent(
    """
    import json, sys
    def hwm():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    import ds4, numpy, hashlib
    from ds4 import _core
    from ds4.checkpoint import open_checkpoint
    from ds4.engine import state_bound
    from ds4.errors import CheckpointError, CorruptCheckpointError
    args = json.loads(sys.argv[1])
    key = _core.derive_auth_key(args["key"].encode()) if args["key"] else None
    eng = ds4.ReferenceEngine()
    bound = state_bound(eng) if args["bound"] else None
    out = {}
    if args.get("redis"):
        from ds4.kvstore import KVStore
        from ds4.kvstore.remote import RemoteTier
        from ds4.loading import try_load_text
        from ds4.recovery import RecoveryReport
        st = KVStore(args["dir"], remote=RemoteTier(args["redis"], chunk_bytes=args["chunk"]), min_tokens=8, auth_key=key)
        sess = ds4.Session(eng, ctx=args["ctx"])
        rep = RecoveryReport()
        before = hwm()
        res = try_load_text(st, sess, args["prompt"], rep)
        out["loaded"] = res is not None
        out["rejected"] = [[stage, code] for (_p, stage, code, _r) in rep.rejected]
    else:
        before = hwm()
        try:
            ck = open_checkpoint(args["path"], auth_key=key, state_bytes=bound)
            out["sha256"] = hashlib.sha256(ck.payload_buffer()).hexdigest()
            out["raw"] = ck.raw_payload_bytes
        except CheckpointError as e:
            out["error"] = [type(e).__name__, e.code, e.kind, str(e), isinstance(e, CorruptCheckpointError)]
    out["grew"] = hwm() - before
    print(json.dumps(out))
    """
)


def child(**args) -> dict:
    """Runs :data:`CHILD` with ``args``; what it printed."""
    args.setdefault("key", "")
    args.setdefault("bound", True)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=600, check=False
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def state_limit() -> int:
    """What a legitimate state of ``TOKENS`` tokens may take (the bound)."""
    b = state_bound(ds4.ReferenceEngine())
    assert b is not None
    return b[0] + b[1] * TOKENS


def assert_refused(out: dict, code: str) -> None:
    assert "error" in out, out
    _name, got, kind, _msg, corrupt = out["error"]
    assert (corrupt, got, kind) == (True, code, "corrupt"), out  # FrameTableError, a CorruptCheckpointError
    assert out["grew"] < state_limit() + FRAME + SLACK, out


def test_a_16_mib_sparse_file_declaring_1_gib_is_refused_in_bounded_memory(tmp_path):
    p = write_v3(tmp_path, "sparse16", 16, 1008)
    hollow(p)
    assert os.path.getsize(p) < 17 * MiB
    assert open_checkpoint(p, load_payload=False).raw_payload_bytes >= 1000 * MiB
    # the engine's bound refuses it before anything is read or allocated
    assert_refused(child(path=p), "frame_table")
    # without one (the ratio rule only) its first frame is found bad and
    # nothing of the 1 GiB buffer is committed
    out = child(path=p, bound=False)
    assert out["error"][1] == "bad_frame" and "frame 0 " in out["error"][3], out
    assert out["grew"] < FRAME + SLACK, out


def test_an_8_kib_file_declaring_2_gib_is_refused_in_bounded_memory(tmp_path):
    p = write_v3(tmp_path, "tiny2g", 36, 2012, span=8 * MiB)
    hollow(p)
    assert os.stat(p).st_blocks * 512 <= 8 * 1024
    assert open_checkpoint(p, load_payload=False).raw_payload_bytes >= 2 << 30
    assert_refused(child(path=p), "frame_table")
    out = child(path=p, bound=False)
    assert out["error"][1] == "bad_frame", out
    assert out["grew"] < FRAME + SLACK, out


def test_a_keyed_1_gib_sparse_file_is_refused_by_its_mac_in_bounded_memory(tmp_path):
    key = _core.derive_auth_key(KEY_SECRET)
    p = write_v3(tmp_path, "keyed1g", 1024, 0, key=key)
    hollow(p)
    assert open_checkpoint(p, load_payload=False).payload_bytes >= 1 << 30
    assert_refused(child(path=p, key=KEY_SECRET.decode()), "frame_table")
    # no bound: the MAC is computed frame by frame over the hole (one frame
    # held at a time) and refuses it; nothing is decompressed
    out = child(path=p, key=KEY_SECRET.decode(), bound=False)
    assert out["error"][1] == "mac_mismatch", out
    assert out["grew"] < FRAME + SLACK, out


def test_a_valid_v3_file_loads_byte_exact_its_peak_about_its_raw_size(tmp_path):
    p = write_v3(tmp_path, "valid64", 64, 0)
    ck = open_checkpoint(p, load_payload=False)
    raw = ck.raw_payload_bytes
    assert ck.payload_bytes > 60 * MiB  # noise: stored about as large as raw
    want = hashlib.sha256(_NOISE.tobytes() * 64).hexdigest()
    out = child(path=p, bound=False)
    assert out.get("sha256") == want and out["raw"] == raw, out
    # the raw buffer, one frame and noise: not raw + stored (a copy of the
    # stored payload, what a load held before)
    assert raw - 4 * MiB < out["grew"] < raw + FRAME + SLACK, out


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
def test_a_forged_download_through_redis_is_refused_in_bounded_memory(node, tmp_path, keyed):
    from ds4.kvstore import KVStore
    from ds4.kvstore.remote import RemoteTier

    with node.client() as c:
        c.flushall()
    key = _core.derive_auth_key(KEY_SECRET) if keyed else None
    src = tmp_path / "a"
    src.mkdir()
    # a file of TOKENS tokens declaring 1 GiB: signed with the key when
    # keyed (a replica's key holder lies), its payload a hole
    p = write_v3(src, f"redis{keyed}", 16, 1008, key=key)
    hollow(p)
    a = KVStore(src, remote=RemoteTier(node.url, chunk_bytes=MiB), min_tokens=8, auth_key=key)
    try:
        a.refresh(force=True)
        assert a.push() == {"stored": 1}
        assert a.remote.flush(30)
    finally:
        a.close()
    out = child(
        redis=node.url,
        chunk=MiB,
        dir=os.fspath(tmp_path / "b"),
        ctx=CTX,
        prompt=_text(f"redis{keyed}").decode() + " and more",
        key=KEY_SECRET.decode() if keyed else "",
    )
    assert not out["loaded"], out
    assert out["rejected"] == [["header", "frame_table"]], out
    assert out["grew"] < state_limit() + FRAME + SLACK + 2 * 16 * MiB, out  # the download's batches
