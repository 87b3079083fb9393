"""Checkpoint files as the tests name and damage them: the names the store
writes (docs/FORMAT.md, "File names": ``<SHA-1 of the key text>-<model tag
of the payload ABI>.kv``) and a flipped byte, in a file or in a
checkpoint's payload only."""

from __future__ import annotations

import os

from ds4 import _core
from ds4.checkpoint import open_checkpoint
from ds4.kvstore import checkpoint_name


def stored_name(text: bytes | str, abi: str) -> str:
    """The name a checkpoint of key text ``text`` written by an engine of
    payload ABI ``abi`` gets."""
    b = text.encode() if isinstance(text, str) else bytes(text)
    return checkpoint_name(_core.sha1_hex(b), abi)


def stored_path(directory: str | os.PathLike[str], text: bytes | str, abi: str) -> str:
    """:func:`stored_name` in ``directory``."""
    return os.path.join(os.fspath(directory), stored_name(text, abi))


def flip_byte(path: str | os.PathLike[str], at: int, mask: int = 0x01) -> None:
    """XOR the byte of ``path`` at offset ``at`` (from the end when
    negative) with ``mask``, in place."""
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_SET if at >= 0 else os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ mask]))


def flip_payload_byte(
    path: str | os.PathLike[str], *, mask: int = 0x40, tensor: str | None = None, keep_mtime: bool = False
) -> None:
    """Damage a checkpoint's payload only: header, text and tensor table
    stay valid, so indexing accepts the file and the payload checksum
    rejects it at load. The byte flipped (XOR ``mask``) is the payload's
    middle one, or with ``tensor`` the first byte of that tensor's data
    (``tensor="logits", mask=1``: the lowest mantissa bit of the first
    logit, a value still finite and plausible). ``keep_mtime``: the file's
    times as before (an index that trusts them sees no change)."""
    ck = open_checkpoint(path, load_payload=False)
    if tensor is None:
        off = ck.payload_offset + ck.payload_bytes // 2
    else:
        [at] = [o for (name, _dt, _shape, o, _n) in ck.tensor_table() if name == tensor]
        off = ck.payload_offset + at
    del ck
    st = os.stat(path)
    flip_byte(path, off, mask)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
