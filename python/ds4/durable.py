"""The one durable small-file write: a whole new file put in a name's place
through a temp file beside it, so a reader sees the old bytes or the new,
never a torn write (``.ds4.writes``, the server's stored records, the chat
index, the llama.cpp engine's kept start-up checks). Checkpoints, blocks and
the index file are the core's writers' (``rust/format/writer.rs``,
``rust/index/file.rs``)."""

from __future__ import annotations

import contextlib
import os
import stat

from . import _core

__all__ = ["write_durably"]


def write_durably(
    name: str,
    data: bytes,
    *,
    dir_fd: int | None = None,
    tmp: str | None = None,
    sync_dir: bool = False,
    regular_only: bool = False,
) -> bool:
    """Replace ``name`` (a name in ``dir_fd``'s directory when given) with ``data``: a
    new 0600 temp file beside it (``tmp``, else ``.<name>.<random>.tmp``),
    created ``O_EXCL | O_NOFOLLOW`` so that nothing planted under its name is
    ever written through (a fixed ``tmp`` a crashed writer left as a regular
    file is removed first), fsynced and renamed over ``name``; then, with
    ``sync_dir``, the directory fsynced. With ``regular_only`` an existing
    ``name`` that is not a regular file (a symlink, a directory) is left
    alone: False, nothing written. The temp file never outlives a failure,
    which is raised (OSError)."""
    head, base = os.path.split(name)
    if tmp is None:
        tmp = os.path.join(head, f".{base}.{os.urandom(6).hex()}.tmp")
    else:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(tmp, dir_fd=dir_fd).st_mode):
                os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if regular_only:
            try:
                if not stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
                    os.unlink(tmp, dir_fd=dir_fd)
                    return False
            except FileNotFoundError:
                pass
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if sync_dir:
        if dir_fd is None:
            _core.sync_dir(head or ".")
        else:
            os.fsync(dir_fd)
    return True
