"""A cache directory's files as the store sees them: the names it reads
(``<sha1>.kv``) and the temp files of writers (ours, ds4-server's and
ds4-agent's), which of those are orphaned, and the directory's one lock.
Only :mod:`ds4.kvstore` uses these."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import re
import stat
import threading
from collections.abc import Iterator

from .. import _core
from ..errors import StoreError

__all__ = [
    "INDEX_NAME",
    "INDEX_TMP_NAME",
    "LOCK_NAME",
    "NOT_REGULAR",
    "TMP_MAX_AGE_S",
    "DirLock",
    "StatKey",
    "checkpoint_name",
    "create_temp",
    "is_checkpoint_name",
    "is_temp_name",
    "legacy_name",
    "open_cache_dir",
    "pid_space",
    "remove_orphaned_temp",
    "scan_dir",
    "stat_key",
    "temp_is_orphaned",
    "temp_writer_pid",
]

log = logging.getLogger("ds4.kvstore")

StatKey = tuple[int, int, int]

# A checkpoint's name: `<sha1>.kv` (every release before per-model names)
# or `<sha1>-<model tag>.kv` (docs/FORMAT.md, "File names"). ds4 reads the
# SHA-1 case-insensitively (an upper-case name loads there): so do we; the
# tag is ours, lower case only.
_NAME_RE = re.compile(r"^[0-9a-fA-F]{40}(?:-[0-9a-f]{16})?\.kv$")
# Temp files of writers: ours `.<name>.tmp.<pid>.<hex>`, ds4-server's
# `<sha>.kv.tmp.<pid>`, ds4-agent's `<sha>.kv.tmp.XXXXXX` (mkstemp).
_TMP_RE = re.compile(r"^\.?[0-9a-fA-F]{40}(?:-[0-9a-f]{16})?\.kv\.tmp\.(?P<tail>[A-Za-z0-9.]+)$")
LOCK_NAME = ".ds4.lock"
#: the persisted index (header facts and a stat key per file) and the one
#: temp file it is written through (under the lock, so by one writer at a
#: time; a crash leaves it for the next write to truncate). Neither is a
#: checkpoint name nor a writer's temp name: no load, scan or removal of the
#: store ever takes them for a checkpoint.
INDEX_NAME = ".ds4.index"
INDEX_TMP_NAME = ".ds4.index.tmp"
#: the code of the error for an entry that is not a regular file (a symlink,
#: a FIFO, a directory with a checkpoint's name): such entries are ignored,
#: never moved or deleted, by every path of the store and the CLI
NOT_REGULAR = "not_regular_file"
TMP_MAX_AGE_S = 3600


def stat_key(st: os.stat_result) -> StatKey:
    """What identifies one version of a file: inode, size, mtime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def is_checkpoint_name(name: str) -> bool:
    """True for ``<40 hex>.kv`` (either case, as ds4 reads them) and
    ``<40 hex>-<16 lowercase hex>.kv`` (a per-model name), the only names the
    store reads or removes."""
    return _NAME_RE.match(name) is not None


def checkpoint_name(sha: str, abi: str) -> str:
    """The name a checkpoint of the key text whose SHA-1 is ``sha`` gets
    when an engine of payload ABI ``abi`` writes it: ``<sha>-<tag>.kv``, the
    tag the first 16 hex digits of the SHA-1 of the ABI (``_core.model_tag``;
    the Redis tier's ABI id). Models whose key texts are the same bytes so
    keep one file each; :func:`legacy_name` is what earlier releases wrote."""
    return f"{sha}-{_core.model_tag(abi)}.kv"


def legacy_name(sha: str) -> str:
    """``<sha>.kv``: the one name per text of releases before per-model
    names. Such files are read, matched and evicted like any other; a save
    finds its own model's there and writes nothing new."""
    return f"{sha}.kv"


def is_temp_name(name: str) -> bool:
    """True for a writer's temp file name (ours, ds4-server's, ds4-agent's)."""
    return _TMP_RE.match(name) is not None


def scan_dir(directory: str) -> tuple[list[str], list[str], list[str]]:
    """(checkpoint files, writers' temp files, other ``.kv`` files) in
    ``directory``, each sorted, as paths."""
    cks, tmps, other = [], [], []
    with os.scandir(directory) as it:
        for de in it:
            if _NAME_RE.match(de.name):
                cks.append(de.path)
            elif _TMP_RE.match(de.name):
                tmps.append(de.path)
            elif de.name.endswith(".kv"):
                other.append(de.path)
    return sorted(cks), sorted(tmps), sorted(other)


def temp_writer_pid(name: str) -> int | None:
    """The writer's pid encoded in a temp file name, when there is one."""
    m = _TMP_RE.match(name)
    if not m:
        return None
    tail = m.group("tail")
    if name.startswith("."):  # ours: .<sha>.kv.tmp.<pid>.<space>.<hex> (older: .<pid>.<hex>)
        head = tail.split(".")[0]
        return int(head) if head.isdigit() else None
    return int(tail) if tail.isdigit() else None  # ds4-server: <pid>; ds4-agent (mkstemp): none


@functools.cache
def pid_space() -> str:
    """This process's PID namespace on this boot of this host, as our writer
    puts it in its temp names (``rust/format/writer.rs``, ``pid_space``):
    the first 12 hex digits of the boot id and the namespace's inode in hex;
    ``x`` when either cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = "".join(c for c in f.read() if c in "0123456789abcdefABCDEF")[:12]
        ino = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return "x"
    return f"{boot}{ino:x}" if len(boot) == 12 else "x"


def _pid_is_ours_to_probe(name: str) -> bool:
    """True when the pid in ``name`` means a process of this PID namespace:
    only our own writer's names say so (ds4-server's and ds4-agent's do not,
    and another container's or host's pid 1234 is not our pid 1234)."""
    m = _TMP_RE.match(name)
    if not m or not name.startswith("."):
        return False
    parts = m.group("tail").split(".")
    here = pid_space()
    return len(parts) == 3 and here != "x" and parts[1] == here


def temp_is_orphaned(name: str, mtime: float, now: float, max_age: float = TMP_MAX_AGE_S) -> bool:
    """A temp file older than ``max_age`` seconds; or one of our own
    writer's, from this PID namespace, whose writer is gone. A foreign
    writer's file (ds4-server's ``<sha>.kv.tmp.<pid>``, ds4-agent's, or ours
    from another container or host) is judged by its age only: its pid may
    be alive where it was written, whatever it is here."""
    pid = temp_writer_pid(name)
    if pid is not None and pid > 0 and pid != os.getpid() and _pid_is_ours_to_probe(name):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    return now - mtime > max_age


class DirLock:
    """The directory's one lock: an exclusive ``flock`` on ``.ds4.lock``,
    re-entrant within one store and one thread (a discard during a store
    already holds it; a second ``flock`` on a new descriptor would wait for
    itself). Another thread of the process waits as another process does
    (the server's worker stores while a request thread deletes a record):
    a thread lock is taken before the ``flock`` and released after it."""

    def __init__(self, directory: str, trust_dir: bool = False):
        self.path = os.path.join(directory, LOCK_NAME)
        self.trust_dir = trust_dir
        self.fd = -1
        self.depth = 0
        self._thread_lock = threading.RLock()

    def _open(self) -> int:
        """The lock file, created without following a symlink, and refused
        when it is anything but a regular file, or (unless the directory is
        trusted) one another user owns: each a :class:`StoreError` naming
        the file."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError as e:
            why = "is a symlink" if e.errno == errno.ELOOP else e.strerror
            raise StoreError(e.errno, f"cannot open the lock file: {why} (remove it)", self.path) from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise StoreError(errno.EINVAL, "the lock file is not a regular file (remove it)", self.path)
        if not self.trust_dir and st.st_uid != os.geteuid():
            os.close(fd)
            raise StoreError(
                errno.EPERM,
                f"the lock file is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): remove it, "
                "or pass trust_dir=True (--kv-trust-dir) if you share the directory with its owner",
                self.path,
            )
        return fd

    @contextlib.contextmanager
    def try_held(self) -> Iterator[bool]:
        """The lock when it is free (or already held by this store in this
        thread), without waiting: yields whether it is held."""
        if not self._thread_lock.acquire(blocking=False):
            yield False
            return
        try:
            if self.depth > 0:
                self.depth += 1
                try:
                    yield True
                finally:
                    self.depth -= 1
                return
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                yield False
                return
            except BaseException:
                os.close(fd)
                raise
            self.fd, self.depth = fd, 1
            try:
                yield True
            finally:
                self.depth = 0
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                self.fd = -1
        finally:
            self._thread_lock.release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._thread_lock:
            if self.depth == 0:
                fd = self._open()
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self.fd = fd
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0:
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
                    os.close(self.fd)
                    self.fd = -1


def create_temp(directory: str, name: str, *, block: bool = False) -> tuple[int, str]:
    """A new temp file for checkpoint ``name`` (or, with ``block``, block
    file ``name``) in ``directory``, named as our writer names its own
    (``.<name>.tmp.<pid>.<space>.<hex>``: a crashed writer's leftover is
    found and removed by a refresh or a listing of ``blocks/``); created
    exclusively, mode 0600, without following a symlink. Returns (fd, path)."""
    if not (re.fullmatch(r"[0-9a-f]{64}\.kvb", name) if block else is_checkpoint_name(name)):
        raise ValueError(f"not a {'block' if block else 'checkpoint'} name: {name!r}")
    path = os.path.join(directory, f".{name}.tmp.{os.getpid()}.{pid_space()}.{os.urandom(6).hex()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return fd, path


def remove_orphaned_temp(path: str, now: float, max_age: float = TMP_MAX_AGE_S) -> bool:
    """Remove a writer's temp file when its writer is gone (see
    :func:`temp_is_orphaned`); True when it was removed. Only a regular file
    is ever removed."""
    name = os.path.basename(path)
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):  # a symlink, FIFO or directory with a temp name: ignored
        return False
    if not temp_is_orphaned(name, st.st_mtime, now, max_age):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    log.info("kv cache removed orphaned temp file %s (writer pid %s)", name, temp_writer_pid(name))
    return True


def open_cache_dir(directory: str | os.PathLike[str], trust_dir: bool = False) -> str:
    """The cache directory's absolute path, created (0700) when missing.

    Refused with :class:`ds4.errors.StoreError`: a path that is not a
    directory or is a symlink; and, unless ``trust_dir``, a directory owned
    by another user or writable by group or others (anyone who can write
    there can plant a checkpoint under a prompt's name, or swap one)."""
    path = os.path.abspath(os.fspath(directory))
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise StoreError(e.errno, f"cannot create cache directory: {e.strerror}", path) from e
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(errno.ENOTDIR, "cache path is not a directory", path)
    if trust_dir:
        return path
    if st.st_uid != os.geteuid():
        raise StoreError(
            errno.EPERM,
            f"cache directory is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): use a directory "
            "of your own, or pass trust_dir=True (--kv-trust-dir) if you trust its owner",
            path,
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StoreError(
            errno.EPERM,
            f"cache directory is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):o}): chmod go-w it, or pass trust_dir=True (--kv-trust-dir)",
            path,
        )
    return path
