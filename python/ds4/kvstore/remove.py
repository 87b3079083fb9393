"""The one way a checkpoint leaves its directory: :func:`remove_exact`.

Every removal of the store (a corrupt file discarded, a victim of eviction,
``ds4 kv rm``) goes through it, under the directory's lock, and removes
only the version of the file that was judged: the caller passes the stat
key (inode, size, mtime) it took *before* it opened the file, and a file
that no longer has that key (a fresh one renamed over it, or the same one
rewritten) stays. Entries that are not regular files (symlinks, FIFOs,
directories with a checkpoint's name) are never moved or deleted.

The check is made on the file itself, not on its name: the entry is first
renamed aside (atomically, in the same directory), the renamed entry is
checked, and an entry that turns out not to be the judged one is linked
back under its name (``link`` never replaces, so a file that arrived even
later wins). So a writer that does not take ds4's lock (ds4-server's own
saves) cannot lose a fresh file to a discard either.

Quarantine moves the file with ``rename``; across filesystems (``EXDEV``)
it copies it (``O_EXCL | O_NOFOLLOW``, mode 0600), fsyncs the copy and the
quarantine directory, then unlinks the original. When the copy cannot be
made, the corrupt file is removed all the same (and that is logged): a
corrupt checkpoint never stays where loads find it."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable

from .. import _core
from ..errors import CheckpointError
from .entries import Entry
from .files import StatKey, stat_key

__all__ = ["discard_exact", "evict_entries", "is_regular", "quarantine_file", "remove_exact"]

log = logging.getLogger("ds4.kvstore")

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def is_regular(path: str) -> bool:
    """True when ``path`` itself (not a symlink's target) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _aside_name(name: str) -> str:
    # Looks like one of our own temp files (.<sha>.kv.tmp.<pid>.<hex>), so a
    # crash between the rename and the unlink leaves an orphan that the next
    # refresh removes (its writer pid is dead), never a stray file.
    return f".{name}.tmp.{os.getpid()}.{os.urandom(4).hex()}"


def _put_back(aside: str, path: str) -> None:
    """Give a file taken aside by mistake its name again, unless a newer
    entry already has it (``link`` never replaces)."""
    try:
        os.link(aside, path, follow_symlinks=False)
    except FileExistsError:
        log.info("kv cache: %s was replaced twice during a discard; the newest stays", os.path.basename(path))
    except OSError as e:  # no hard links here: a rename, only while the name is free
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV) or os.path.lexists(path):
            raise
        os.rename(aside, path)
        return
    os.unlink(aside)


def quarantine_file(src: str, dest_dir: str, dest_name: str) -> str:
    """Move ``src`` into ``dest_dir`` as ``dest_name``: ``rename``, or on
    another filesystem a copy (fsync'd, then the directory) and an unlink of
    ``src``. Returns the new path. Raises OSError when neither works (then
    ``src`` is untouched and a partial copy is removed)."""
    os.makedirs(dest_dir, mode=0o700, exist_ok=True)
    dest = os.path.join(dest_dir, dest_name)
    try:
        os.rename(src, dest)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        _copy_durably(src, dest)
        os.unlink(src)
    _core.sync_dir(dest_dir)
    return dest


def _copy_durably(src: str, dest: str) -> None:
    with open(os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fin:
        fd = os.open(dest, _CREATE, 0o600)
        try:
            with open(fd, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
                fout.flush()
                os.fsync(fout.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(dest)
            raise


def remove_exact(
    directory: str,
    name: str,
    expect: StatKey | None,
    *,
    quarantine_dir: str | None = None,
    tag: str = "",
    sync: bool = True,
) -> str | None:
    """Remove (or quarantine, as ``<name>.<tag>``) the entry ``name`` of
    ``directory`` when it is a regular file whose stat key is ``expect``
    (any regular file when ``expect`` is None: an explicit ``kv rm``). The
    caller holds the directory's lock. Returns where it went (the quarantine
    path, or its own path when removed), or None when it was gone, replaced,
    or not a regular file. Raises OSError when it could not be removed.
    With ``sync`` False the directory is not fsync'd: a caller removing
    several files fsyncs it once after the last."""
    if os.sep in name or name in ("", ".", ".."):
        raise ValueError(f"not a file name: {name!r}")
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        log.warning("kv cache ignoring %s: not a regular file (never moved or deleted)", name)
        return None
    if expect is not None and stat_key(st) != expect:
        log.info("kv cache kept %s: it changed since it was judged", name)
        return None
    aside = os.path.join(directory, _aside_name(name))
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    got = os.lstat(aside)
    if not stat.S_ISREG(got.st_mode) or stat_key(got) != stat_key(st):
        _put_back(aside, path)  # swapped between the check and the rename
        return None
    return _dispose(directory, aside, path, quarantine_dir, f"{name}.{tag}" if tag else name, sync)


def discard_exact(
    directory: str, name: str, err: CheckpointError, where: str, expect: StatKey | None, quarantine_dir: str | None
) -> str | None:
    """:func:`remove_exact` for a corrupt file (``err``, found by ``where``),
    the caller holding the directory's lock: removed, or moved to
    ``quarantine_dir`` tagged with the time and the error's code, and
    logged. Where it went, or None when it was gone or replaced."""
    dest = remove_exact(directory, name, expect, quarantine_dir=quarantine_dir, tag=f"{int(time.time())}.{err.code}")
    how = f"stage={err.stage} code={err.code} reason={err.reason} ({where})"
    if dest == os.path.join(directory, name):
        log.warning("kv cache removed corrupt file=%s %s", name, how)
    elif dest is not None:
        log.warning("kv cache quarantined corrupt file=%s %s -> %s", name, how, dest)
    return dest


def _dispose(directory: str, aside: str, path: str, quarantine_dir: str | None, dest_name: str, sync: bool) -> str:
    dest = path
    if quarantine_dir:
        try:
            dest = quarantine_file(aside, quarantine_dir, dest_name)
        except OSError as e:
            log.error("kv cache could not quarantine %s (%s): removed instead", os.path.basename(path), e)
    if dest == path:
        os.unlink(aside)
    if sync:
        _core.sync_dir(directory)
    return dest


def evict_entries(directory: str, victims: Iterable[Entry], why: str = "disk-cache-full") -> list[str]:
    """Remove eviction's ``victims`` (each only as it was indexed: a file
    replaced since stays); one failure does not stop the others. The caller
    holds the directory's lock, and fsyncs the directory once after the
    pass (each removal does not). Returns the names removed, in order.
    ``why`` is logged: ``disk-cache-full`` (the budget), ``superseded`` (a
    continued snapshot a longer one of its text replaced)."""
    removed: list[str] = []
    for victim in victims:
        try:
            if remove_exact(directory, victim.name, victim.stat_key or None, sync=False) is None:
                continue
        except OSError as e:
            log.error("kv cache eviction could not remove %s: %s (continuing)", victim.name, e)
            continue
        log.info(
            "kv cache evicted reason=%s tokens=%d hits=%d size=%.2f MiB file=%s",
            why,
            victim.tokens,
            victim.hits,
            victim.size / 2**20,
            victim.name,
        )
        removed.append(victim.name)
    return removed
