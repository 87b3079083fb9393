"""Reading a llama.cpp state blob: bounds-checked little-endian fields
(:class:`_Reader`), shared by the KV caches' walker
(:mod:`~ds4.engines.llamacpp_state`) and the recurrent part's
(:mod:`~ds4.engines.llamacpp_recurrent`)."""

from __future__ import annotations

import numpy as np

from ..errors import EngineStateError

#: bounds on a K/V or recurrent row (bytes) and on a memory's layers
_MAX_ROW = 1 << 24
_MAX_LAYERS = 4096


# Each reads exactly its field: .item() fails unless the slice holds one value
# (indexing [0] would also accept a longer slice).
def _u32(b: np.ndarray, at: int = 0) -> int:
    return int(b[at : at + 4].view("<u4").item())


def _i32(b: np.ndarray, at: int = 0) -> int:
    return int(b[at : at + 4].view("<i4").item())


def _u64(b: np.ndarray, at: int) -> int:
    return int(b[at : at + 8].view("<u8").item())


class _Reader:
    """Reads a blob front to back; every read is bounds-checked first."""

    def __init__(self, blob: np.ndarray):
        self.blob = blob
        self.size = int(blob.size)
        self.off = 0

    def take(self, n: int, what: str) -> np.ndarray:
        """The next ``n`` bytes; EngineStateError if fewer are left."""
        if n < 0 or self.off + n > self.size:
            raise EngineStateError(f"llama_state truncated in {what} (at byte {self.off} of {self.size})")
        out = self.blob[self.off : self.off + n]
        self.off += n
        return out
