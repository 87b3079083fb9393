"""Which manifest names which blocks, kept beside the blocks
(``blocks/.refs``) so that a store that opens the directory again knows a
manifest's references without reading its table (docs/DESIGN.md,
"Blocks"). It is a cache of what the manifests say: a record counts only
while its manifest's stat key (inode, size, mtime) is the one recorded,
and a file that cannot be read (missing, damaged, not a regular file,
another version) is no record at all; the manifests are read again then.
Written under the store's lock through a temp file and a rename; not
fsync'd (a torn file after a crash is a damaged one: read again)."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable

__all__ = ["REFS_NAME", "Refs", "read_refs", "write_refs"]

REFS_NAME = ".refs"
_TMP = ".refs.tmp"
_HEX = re.compile(r"^[0-9a-f]{64}$")
#: the most bytes of a references file read (larger: not read)
MAX_BYTES = 256 << 20

#: manifest name -> (its stat key: inode, size, mtime in ns; its blocks, hex)
Refs = dict[str, tuple[tuple[int, ...], tuple[str, ...]]]


def read_refs(blocks_dir: str) -> Refs:
    """The records of ``blocks_dir``'s references file: manifest name ->
    (its stat key, its blocks); empty when there is none or it cannot be
    trusted to be one."""
    try:
        fd = os.open(os.path.join(blocks_dir, REFS_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return {}
        with os.fdopen(os.dup(fd), "rb") as f:
            doc = json.loads(f.read())
        return _parse(doc)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return {}
    finally:
        os.close(fd)


def _parse(doc: object) -> Refs:
    if not isinstance(doc, dict) or doc.get("version") != 1:
        return {}
    blocks = doc["blocks"]
    if not isinstance(blocks, list) or not all(isinstance(h, str) and _HEX.match(h) for h in blocks):
        return {}
    out: Refs = {}
    for name, rec in doc["files"].items():
        ino, size, mtime, idx = rec
        key = (int(ino), int(size), int(mtime))
        if not isinstance(name, str) or not isinstance(idx, list):
            return {}
        out[name] = (key, tuple(blocks[int(i)] for i in idx if 0 <= int(i) < len(blocks)))
        if len(out[name][1]) != len(idx):
            return {}
    return out


def write_refs(blocks_dir: str, records: Iterable[tuple[str, tuple[int, ...], tuple[str, ...]]]) -> None:
    """Replace ``blocks_dir``'s references file with ``records`` (name, stat
    key, blocks); the caller holds the store's lock. Never over an entry
    that is not a regular file."""
    index: dict[str, int] = {}
    files = {}
    for name, key, refs in records:
        files[name] = [*key, [index.setdefault(h, len(index)) for h in refs]]
    data = json.dumps({"version": 1, "blocks": list(index), "files": files}, separators=(",", ":")).encode()
    dst = os.path.join(blocks_dir, REFS_NAME)
    if os.path.lexists(dst) and not stat.S_ISREG(os.lstat(dst).st_mode):
        return
    tmp = os.path.join(blocks_dir, _TMP)
    try:
        if stat.S_ISREG(os.lstat(tmp).st_mode):
            os.unlink(tmp)  # a crashed writer's: ours (the lock is held)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, dst)
