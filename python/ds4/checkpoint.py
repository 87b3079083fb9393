"""Checkpoint files: write (durably) and open (verified, zero-copy).

Python never parses checkpoint bytes: the Rust core verifies the file and
exports each payload tensor as a read-only buffer over the memory map;
:meth:`Checkpoint.arrays` wraps those buffers in numpy arrays whose base
keeps the map alive.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _core
from .errors import CheckpointError, EngineStateError, TensorTableError, TokenCountMismatchError

if TYPE_CHECKING:  # numpy is imported where arrays are made: a store that only looks up never loads it
    import numpy as np

__all__ = [
    "REASONS",
    "TOKENS_TENSOR",
    "Checkpoint",
    "check_tokens",
    "open_checkpoint",
    "reason_code",
    "write_checkpoint",
]

#: payload tensor holding the session's tokens (int32); reserved name
TOKENS_TENSOR = "tokens"

REASONS: tuple[str, ...] = tuple(_core.REASONS)

Buffer = bytes | bytearray | memoryview
if TYPE_CHECKING:
    BytesLike = Buffer | np.ndarray


def reason_code(reason: str | int) -> int:
    if isinstance(reason, int):
        return reason
    try:
        return REASONS.index(reason)
    except ValueError:
        return REASONS.index("named")


def _as_text(text: str | BytesLike) -> Buffer:
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return text
    return text.data  # an ndarray


def _tensor_entry(name: str, a: np.ndarray | BytesLike) -> tuple[str, str, list[int], memoryview]:
    import numpy as np

    if not isinstance(a, np.ndarray):
        a = np.frombuffer(a, dtype=np.uint8)
    if a.dtype.byteorder == ">":
        raise ValueError(f"tensor {name!r}: big-endian arrays are not supported")
    shape = list(a.shape)  # taken before any reshaping (0-d arrays keep shape [])
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    raw = a.reshape(-1).view(np.uint8).data if a.size else memoryview(b"")
    return (name, a.dtype.str, shape, raw)


def write_checkpoint(
    path: str | os.PathLike[str],
    text: str | BytesLike,
    arrays: Mapping[str, np.ndarray | BytesLike],
    *,
    abi: str,
    tokens: int,
    ctx: int,
    reason: str | int = "cold",
    quant_bits: int = 0,
    flags: int = 0,
    created: int | None = None,
    auth_key: bytes | None = None,
    drop_cache: bool = True,
    codec: str = "none",
    level: int = 1,
    filter: str = "shuffle2",
) -> int:
    """Write a checkpoint durably (temp file, fsync, rename, fsync dir):
    v2, or with ``codec="zstd"`` v3, its payload in 1 MiB frames each
    compressed at ``level`` after ``filter`` (``"shuffle2"``: the bytes of
    each f16 split; ``"none"``), docs/FORMAT.md §1.10.

    ``arrays`` maps tensor names to numpy arrays (any supported dtype) or
    bytes-like blobs (stored as uint8). They are streamed to disk in order,
    never concatenated. With ``auth_key`` (32 bytes, from
    :func:`ds4._core.derive_auth_key`) the file carries a keyed MAC
    (docs/FORMAT.md §1.9). With ``drop_cache`` (the default) the written
    pages leave the page cache once fsynced (``posix_fadvise(DONTNEED)``,
    best-effort: a save never fails for it). Returns the file size in bytes."""
    entries = [_tensor_entry(n, a) for n, a in arrays.items()]
    size, _ = _core.write_checkpoint(
        os.fspath(path),
        _as_text(text),
        entries,
        abi=abi,
        tokens=tokens,
        ctx=ctx,
        reason=reason_code(reason),
        quant_bits=quant_bits,
        flags=flags,
        created=int(time.time()) if created is None else created,
        auth_key=auth_key,
        drop_cache=drop_cache,
        codec=codec,
        level=level,
        filter=filter,
    )
    return size


class Checkpoint:
    """A verified checkpoint (v2 or v3, or ds4's v1) opened through the Rust
    core. A v3 payload was decompressed into a buffer the arrays view."""

    def __init__(self, core: _core.Checkpoint):
        self._core = core

    def __getattr__(self, name: str) -> Any:
        if name == "_core":  # not yet set (copy/pickle): avoid recursing
            raise AttributeError(name)
        return getattr(self._core, name)

    def __repr__(self) -> str:
        return repr(self._core)

    @property
    def text_str(self) -> str:
        return self._core.text.decode("utf-8", errors="replace")

    def tensor_table(self) -> list[tuple[str, str, list[int], int, int]]:
        return self._core.tensor_table()

    def _view(self, name: str, dtype: str, shape: list[int], nbytes: int) -> np.ndarray:
        import numpy as np

        dt = np.dtype(dtype)
        buf = self._core.tensor_buffer(name)
        # numpy's stubs list the buffer types they know, not PEP 688's Buffer
        arr: np.ndarray = np.frombuffer(buf, dtype=dt, count=nbytes // dt.itemsize)  # type: ignore[call-overload]
        return arr.reshape(shape)

    def array(self, name: str) -> np.ndarray:
        """One payload tensor as a read-only numpy array over the map."""
        for n, dtype, shape, _off, nbytes in self._core.tensor_table():
            if n == name:
                return self._view(n, dtype, shape, nbytes)
        raise KeyError(name)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every payload tensor, by name, as read-only zero-copy arrays (the
        arrays' base keeps the map alive after this object is gone). A
        tensor numpy cannot view is a :class:`TensorTableError` (the Rust
        table check rules those out; this keeps any miss typed)."""
        try:
            return {n: self._view(n, dt, shape, nbytes) for n, dt, shape, _off, nbytes in self._core.tensor_table()}
        except CheckpointError:
            raise
        except (ValueError, TypeError, OverflowError, MemoryError) as e:
            raise TensorTableError(f"a tensor cannot be viewed: {e}", path=str(self._core.path)) from e

    def load_arrays(self) -> dict[str, np.ndarray]:
        """:meth:`arrays` and the checks every load makes before an engine
        sees them (:func:`check_tokens`): what ``ds4 kv verify`` runs too."""
        arrays = self.arrays()
        check_tokens(arrays, self._core.tokens)
        return arrays

    def joined(self, arrays: dict[str, np.ndarray]) -> Checkpoint:
        """This checkpoint with ``arrays`` as its payload: a manifest's state
        joined from its verified blocks (:mod:`ds4.kvstore.blocks`); the
        header, text, lease and checks stay the manifest's."""
        return _Joined(self._core, arrays)


class _Joined(Checkpoint):
    def __init__(self, core: _core.Checkpoint, arrays: dict[str, np.ndarray]):
        super().__init__(core)
        self._joined = arrays

    def arrays(self) -> dict[str, np.ndarray]:
        return dict(self._joined)


def check_tokens(arrays: Mapping[str, np.ndarray], n_tokens: int) -> np.ndarray:
    """The payload's ``tokens`` tensor, checked against the header: int32,
    one dimension, ``n_tokens`` (at least one) entries, none negative.
    Raises typed corrupt-checkpoint errors."""
    import numpy as np

    toks = arrays.get(TOKENS_TENSOR)
    if toks is None or toks.ndim != 1 or toks.dtype != np.int32:
        raise EngineStateError("payload has no int32 'tokens' tensor")
    if toks.shape[0] != n_tokens:
        raise TokenCountMismatchError(f"payload holds {toks.shape[0]} tokens, the header says {n_tokens}")
    if n_tokens <= 0:
        raise TokenCountMismatchError("payload holds no tokens")
    if int(toks.min()) < 0:
        raise EngineStateError("payload tokens are out of the vocabulary's range")  # negative: of any vocabulary
    return toks


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    prompt: str | BytesLike | None = None,
    expected_abi: str | None = None,
    quant_bits: int | None = None,
    ctx: int | None = None,
    check_name: bool = True,
    load_payload: bool = True,
    verify_checksum: bool = True,
    mmap: bool = True,
    auth_key: bytes | None = None,
    max_raw_bytes: int | None = None,
    state_bytes: tuple[int, int] | None = None,
) -> Checkpoint:
    """Run the verification pipeline on ``path``; raise a
    :class:`ds4.errors.CheckpointError` subclass at the first failure. With
    ``auth_key``, the file must carry a valid MAC (docs/FORMAT.md §1.9).
    A compressed (v3) file declaring more raw payload bytes than
    ``max_raw_bytes``, or than ``fixed + per_token * tokens`` for
    ``state_bytes=(fixed, per_token)`` (what the engine's state of that
    many tokens can take), is refused (``frame_table``, corrupt) before
    anything is allocated (docs/FORMAT.md §1.10)."""
    return Checkpoint(
        _core.open_checkpoint(
            os.fspath(path),
            expected_abi=expected_abi,
            quant_bits=quant_bits,
            ctx=ctx,
            check_name=check_name,
            prompt=None if prompt is None else _as_text(prompt),
            load_payload=load_payload,
            verify_checksum=verify_checksum,
            mmap=mmap,
            auth_key=auth_key,
            max_raw_bytes=max_raw_bytes,
            state_bytes=state_bytes,
        )
    )
