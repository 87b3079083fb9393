"""The store's knobs: :class:`StorePolicy`, one frozen value
(:func:`ds4.config.make_store` builds it from the ``--kv-*`` flags; the
defaults are ds4's), and the store lengths it decides (ds4's cold store
length, the chat anchor, the continued interval)."""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Callable, Sequence

__all__ = ["CHATML_MARKERS", "StorePolicy", "chat_anchor"]


#: the user and assistant turn markers of the ChatML template both engines
#: render (ds4's own template has its own User and Assistant marker tokens)
CHATML_MARKERS = (b"<|im_start|>user", b"<|im_start|>assistant")


def chat_anchor(
    tokens: Sequence[int], token_bytes: Callable[[int], bytes], markers: tuple[bytes, bytes] = CHATML_MARKERS
) -> int | None:
    """ds4's chat anchor (``ds4_kvstore_chat_anchor_pos``): the token
    position where the last user marker before the first assistant marker
    begins, in the text ``tokens`` render. A prefix ending there is the
    conversation's shared head (system prompt, earlier turns) without the
    task's own user turn. None when there is no such marker, or when it
    does not begin on a token boundary."""
    user, assistant = markers
    text = bytearray()
    starts: list[int] = []  # byte offset where each token begins
    for t in tokens:
        starts.append(len(text))
        text += token_bytes(t)
    first_asst = text.find(assistant)
    head = text if first_asst < 0 else text[:first_asst]
    at = head.rfind(user)
    if at <= 0:
        return None
    i = bisect.bisect_left(starts, at)
    return i if i < len(starts) and starts[i] == at else None


@dataclasses.dataclass(frozen=True)
class StorePolicy:
    """What a :class:`ds4.kvstore.KVStore` stores, keeps, loads and evicts."""

    #: the directory's budget in MiB (records count in it)
    budget_mb: float = 4096
    #: the shortest checkpoint stored or loaded
    min_tokens: int = 512
    #: the longest prompt whose cold prefix a full prefill stores
    cold_max_tokens: int = 30000
    #: a continued checkpoint every this many tokens (aligned up)
    continued_interval_tokens: int = 10000
    boundary_trim_tokens: int = 32
    boundary_align_tokens: int = 2048
    #: refuse a checkpoint of another quantization
    reject_different_quant: bool = True
    #: where corrupt files go (None: removed; a path-like is taken as its str)
    quarantine_dir: str | None = None
    verify_checksum: bool = True
    mmap: bool = True
    #: ds4's consume: a load longer than ``cold_max_tokens`` deletes the file
    consume_over_cold_max: bool = False
    chat_markers: tuple[bytes, bytes] = CHATML_MARKERS
    #: the share of the budget one tenant may hold before its own files are
    #: evicted first (1: no shares, ds4's one order)
    tenant_share: float = 1.0
    #: eviction scores an explicit checkpoint (``cold``, ``evict``,
    #: ``shutdown``) this many times a ``continued`` one (ds4 PR #177's 4;
    #: 1: ds4's one score for all)
    explicit_weight: float = 4.0
    #: an entry never hit and younger than this (seconds since it was
    #: written) is evicted only when nothing else can go (0: no guard)
    fresh_guard_s: float = 60.0
    #: a continued save removes the continued snapshots of its own prefill
    #: that it supersedes (ds4 PR #175; False: every snapshot stays, ds4's
    #: store before it, the "before" arm of ``benches/bench_store_replay.py``)
    supersede: bool = True
    #: a turn boundary more than this many tokens prefilled past the
    #: conversation's last state on disk is stored before the live state
    #: holding it goes, and at once on a reload loop (:mod:`ds4.frontier`;
    #: 0: never)
    frontier_tokens: int = 512
    #: the payload codec of the checkpoints written: "none" (v2, loaded
    #: zero-copy) or "zstd" (v3: 1 MiB frames, shuffle2 then zstd at
    #: ``codec_level``; BENCHMARKS.md §2.4 for why "none" is the default)
    codec: str = "none"
    codec_level: int = 1
    #: a checkpoint's append-only state in shared block files of this many
    #: tokens (rounded up to the engine's batch granule), the checkpoint a
    #: manifest naming them (:mod:`.blocks`; False: one file each, as before)
    blocks: bool = False
    block_tokens: int = 64
    #: GB (1e9 bytes) the directory's saves may write in any 24 hours, every
    #: process sharing it counted (:mod:`.writes`); 0: no budget
    write_budget_gb_per_day: float = 0.0

    def __post_init__(self) -> None:
        if self.codec not in ("none", "zstd"):
            raise ValueError(f"codec must be 'none' or 'zstd', not {self.codec!r}")
        if not 1 <= self.codec_level <= 22:
            raise ValueError(f"codec_level must be in 1..22, not {self.codec_level!r}")
        if not 0.0 < self.tenant_share <= 1.0:
            raise ValueError(f"tenant_share must be in (0, 1], not {self.tenant_share!r}")
        if not self.explicit_weight >= 1.0:
            raise ValueError(f"explicit_weight must be >= 1, not {self.explicit_weight!r}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, not {self.block_tokens!r}")
        if not 0.0 <= self.write_budget_gb_per_day < float("inf"):
            raise ValueError(f"write_budget_gb_per_day must be >= 0, not {self.write_budget_gb_per_day!r}")
        if self.frontier_tokens < 0:
            raise ValueError(f"frontier_tokens must be >= 0, not {self.frontier_tokens!r}")
        if not self.fresh_guard_s >= 0.0:
            raise ValueError(f"fresh_guard_s must be >= 0, not {self.fresh_guard_s!r}")
        object.__setattr__(self, "quarantine_dir", os.fspath(self.quarantine_dir) if self.quarantine_dir else None)

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_mb * 1024 * 1024)

    @property
    def write_budget_bytes(self) -> int:
        """The write budget in bytes a day (0: none)."""
        return int(self.write_budget_gb_per_day * 1e9)

    def cold_store_len(self, n_tokens: int) -> int | None:
        """ds4's cold store length: trim the tail (BPE boundary safety) and
        align down. Unlike ds4, a prompt too short to align keeps the trim
        (ds4's own cold save drops it); None when even that is below min_tokens."""
        if n_tokens < self.min_tokens:
            return None
        trimmed = n_tokens - self.boundary_trim_tokens
        if self.boundary_align_tokens > 0:
            aligned = trimmed // self.boundary_align_tokens * self.boundary_align_tokens
            if aligned >= self.min_tokens:
                return aligned
        return trimmed if trimmed >= self.min_tokens else None

    def cold_store_at(self, tokens: Sequence[int], token_bytes: Callable[[int], bytes]) -> int | None:
        """Where ds4 stores a prompt's cold checkpoint: at the chat anchor
        (:func:`chat_anchor`: the last user marker before the first
        assistant marker, so the key leaves out the task's own user turn)
        when it is at least ``min_tokens``, not aligned, as ds4; otherwise
        :meth:`cold_store_len`."""
        anchor = chat_anchor(tokens, token_bytes, self.chat_markers)
        if anchor is not None and anchor >= max(1, self.min_tokens):
            return anchor
        return self.cold_store_len(len(tokens))

    def continued_step(self) -> int:
        a = max(1, self.boundary_align_tokens)
        return (self.continued_interval_tokens + a - 1) // a * a
