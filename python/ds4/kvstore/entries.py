"""What the store's index holds: one :class:`Entry` per checkpoint (its
header facts, its cache namespace and ds4's eviction score), the results of
a lookup and a load, and ds4's eviction order (with the tenants' shares)."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, overload

from ..keytext import ANONYMOUS, namespace_of, tenant_of_namespace
from .files import StatKey
from .rejection import Rejection, import_failure

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from ..errors import CheckpointError
    from .remote_layout import RemoteEntry

__all__ = [
    "EXPLICIT_REASONS",
    "HALF_LIFE_S",
    "Candidates",
    "Entry",
    "IndexRow",
    "LoadResult",
    "Matches",
    "NamedLoad",
    "Rejection",
    "import_failure",
    "model_label",
    "model_of",
    "model_usage",
    "plan_eviction",
    "tenant_usage",
]

HALF_LIFE_S = 6 * 3600
#: the reasons of an explicit checkpoint (a cold prefix, a session saved as
#: it is evicted or at shutdown), which :attr:`StorePolicy.explicit_weight`
#: favours over the ``continued`` snapshots taken during a long prefill
EXPLICIT_REASONS = frozenset({"cold", "evict", "shutdown"})

# One entry of the core's index: (name, version, tokens, text_bytes, hits,
# created, last_used, abi, reason, ctx, stat key, namespace); the size is the
# stat key's
IndexRow = tuple[str, int, int, int, int, int, int, str, str, int, tuple[int, int, int], str | None]


@dataclasses.dataclass
class Entry:
    """What the index knows of one checkpoint file (from its header)."""

    name: str
    path: str
    version: int
    tokens: int
    text_bytes: int
    hits: int
    created: int
    last_used: int
    size: int
    abi: str
    reason: str
    ctx: int
    stat_key: StatKey | tuple[()]
    #: the cache namespace its text's preamble names (None: the default
    #: namespace, or a start that is no whole preamble; docs/FORMAT.md §6)
    namespace: str | None = None

    @property
    def tenant(self) -> str | None:
        """The tenant whose share of the budget the file counts against
        (:func:`ds4.keytext.tenant_of_namespace`: salts of one tenant are
        that tenant; None: the default namespace, whose tenant, the
        anonymous caller, also owns its salted namespaces)."""
        tenant = tenant_of_namespace(self.namespace)
        return None if tenant == ANONYMOUS else tenant

    @classmethod
    def from_checkpoint(cls, ck: Checkpoint, path: str, stat_key: StatKey | tuple[()] = ()) -> Entry:
        """The index entry for a verified header."""
        return cls(
            name=os.path.basename(path),
            path=path,
            version=ck.version,
            tokens=ck.tokens,
            text_bytes=ck.text_bytes,
            hits=ck.hits,
            created=ck.created,
            last_used=ck.last_used,
            size=ck.file_size,
            abi=ck.abi,
            reason=ck.reason_name,
            ctx=ck.ctx,
            stat_key=stat_key,
            namespace=text_namespace(ck.text),
        )

    @classmethod
    def from_row(cls, directory: str, row: IndexRow) -> Entry:
        """The entry for one row of the core's index (``StoreIndex``)."""
        name, version, tokens, text_bytes, hits, created, last_used, abi, reason, ctx, key, ns = row
        path = os.path.join(directory, name)
        return cls(name, path, version, tokens, text_bytes, hits, created, last_used, key[1], abi, reason, ctx, key, ns)

    def score(self, now: float, half_life: float = HALF_LIFE_S, explicit_weight: float = 1.0) -> float:
        """ds4's score ``(hits * 2^(-age/half_life) + 1) * tokens / size``,
        times ``explicit_weight`` for an explicit checkpoint
        (:data:`EXPLICIT_REASONS`)."""
        used = self.last_used or self.created
        age = max(0.0, now - used) if used else 0.0
        eff = self.hits * 2.0 ** (-age / half_life) if used else 0.0
        if eff < 0.01:
            eff = 0.0
        weight = explicit_weight if self.reason in EXPLICIT_REASONS else 1.0
        return (eff + 1.0) * self.tokens / max(1, self.size) * weight

    def fresh(self, now: float, guard_s: float) -> bool:
        """Never hit and written less than ``guard_s`` seconds ago (a file
        without a creation time is not fresh): eviction spares it while
        anything else can go."""
        return guard_s > 0 and self.hits == 0 and self.created > 0 and now - self.created < guard_s


def text_namespace(text: bytes) -> str | None:
    """The namespace a stored text's preamble names, as the index reads it
    (``rust/index.rs`` ``namespace_of``): a start that is no whole,
    well-formed preamble is the default namespace's."""
    try:
        return namespace_of(bytes(text[:_NS_READ]))[0]
    except ValueError:
        return None


#: the longest preamble: FF 00 "ns:", a 128-byte id, FF 00
_NS_READ = 5 + 128 + 2


@dataclasses.dataclass
class LoadResult:
    path: str
    tokens: int
    text_bytes: int
    #: ``local`` (a file of the directory) or ``remote`` (downloaded from
    #: the shared tier, verified, then loaded as a local file)
    tier: str = "local"


#: what :class:`Matches` asks of an entry before it offers it
Check = Callable[[Entry], tuple[Entry | None, list[Rejection]]]


class Matches(Sequence[Entry]):
    """The local candidates of one lookup, longest first, built as they are
    asked for: the core's cursor (``StoreIndex.prefixes``) found the
    longest when the lookup was made and finds each next one only when
    the ladder gets past the one before (a load that failed), so a hit
    costs one SHA-1 pass of the prompt and one :class:`Entry`, whatever
    the number of stored prefixes. Iterating again, indexing and ``len``
    (which finds them all) see the same entries in the same order.

    ``check`` sees each entry before it is offered (the store's: its file
    stat'ed, and read again when it changed behind the index,
    :meth:`ds4.kvstore.indexed.DirIndex.current`): it returns the entry to
    offer (or None) and the rejections it made, kept in :attr:`refused`."""

    def __init__(self, directory: str, rows: Iterable[IndexRow] = (), check: Check | None = None):
        self._dir = directory
        self._rows: Iterator[IndexRow] | None = iter(rows)
        self._got: list[Entry] = []
        self._check = check
        #: files refused by ``check`` (found corrupt before they were offered)
        self.refused: list[Rejection] = []

    def _fill(self, n: int) -> bool:
        """Build entries until there are ``n`` (or none is left); whether there are."""
        while len(self._got) < n and self._rows is not None:
            row = next(self._rows, None)
            if row is None:
                self._rows = None
                continue
            e: Entry | None = Entry.from_row(self._dir, row)
            if self._check is not None and e is not None:
                e, refused = self._check(e)
                self.refused.extend(refused)
            if e is not None:
                self._got.append(e)
        return len(self._got) >= n

    def take_refused(self) -> list[Rejection]:
        """The files refused since the last call."""
        out, self.refused = self.refused, []
        return out

    @property
    def built(self) -> int:
        """How many entries were built so far."""
        return len(self._got)

    def __iter__(self) -> Iterator[Entry]:
        i = 0
        while self._fill(i + 1):
            yield self._got[i]
            i += 1

    def __bool__(self) -> bool:
        return self._fill(1)

    def __len__(self) -> int:
        self._fill(sys.maxsize)
        return len(self._got)

    @overload
    def __getitem__(self, i: int) -> Entry: ...
    @overload
    def __getitem__(self, i: slice) -> list[Entry]: ...
    def __getitem__(self, i: int | slice) -> Entry | list[Entry]:
        if isinstance(i, slice) or i < 0:
            self._fill(sys.maxsize)
        else:
            self._fill(i + 1)
        return self._got[i]

    def __repr__(self) -> str:
        more = "" if self._rows is None else ", ..."
        return f"Matches({self._got!r}{more})"


@dataclasses.dataclass
class Candidates:
    """What one lookup found for a prompt: the indexed checkpoints whose
    name is the SHA-1 of a prefix of it (longest first, :class:`Matches`
    when the store made it: built as the ladder asks for them; their
    headers were verified when indexed, every load verifies the whole
    file again), and the files rejected while indexing since the last
    lookup. ``namespace`` is the cache namespace of the lookup
    (:mod:`ds4.keytext`; None: the default). With a shared tier: its
    matching checkpoints (longest first; nothing downloaded yet) and its
    state when asked (``""`` without a tier)."""

    prompt: bytes
    entries: Sequence[Entry]
    rejected: list[Rejection]
    namespace: str | None = None
    remote: list[RemoteEntry] = dataclasses.field(default_factory=list)
    remote_state: str = ""

    def longest(self) -> int:
        """The longest stored prefix in bytes, local or remote (-1: none)."""
        best = self.entries[0].text_bytes if self.entries else -1
        return max(best, self.remote[0].text_bytes) if self.remote else best


@dataclasses.dataclass
class NamedLoad:
    """The outcome of :func:`ds4.loading.load_named`: ``loaded``, ``missing``,
    ``corrupt`` (the file was removed or quarantined) or ``unusable`` (kept)."""

    status: str
    tokens: int = 0
    ms: float = 0.0
    error: CheckpointError | None = None


def plan_eviction(
    entries: list[Entry],
    limit: int,
    now: float,
    protect: str | None = None,
    tenant_share: float = 1.0,
    *,
    explicit_weight: float = 1.0,
    fresh_guard_s: float = 0.0,
) -> list[Entry]:
    """ds4's eviction order: while the total is over ``limit``, the entry
    with the lowest score goes (ties: least recently used, then the file
    written first); ``protect`` (the newest file) never does.

    An explicit checkpoint's score is ``explicit_weight`` times ds4's
    (:meth:`Entry.score`); a fresh entry (:meth:`Entry.fresh`: never hit,
    younger than ``fresh_guard_s``) goes only when no other entry is left
    to go. The defaults (1, 0) are ds4's own order; the store passes its
    policy's (:class:`StorePolicy`: 4 and 60 s).

    With ``tenant_share`` F < 1, a tenant (:attr:`Entry.tenant`) holding
    more than F x ``limit`` bytes loses its own entries first, in that
    order among them (of several such tenants, the lowest entry of theirs
    goes); a tenant within its share loses an entry only when no tenant
    over it has one left to lose (a fresh one of the tenant over its share
    only after every entry that is not fresh)."""

    def order(e: Entry) -> tuple[bool, float, int, int]:
        return (
            e.fresh(now, fresh_guard_s),
            e.score(now, explicit_weight=explicit_weight),
            e.last_used or e.created,
            e.stat_key[2] if e.stat_key else 0,
        )

    total = sum(e.size for e in entries)
    pool = sorted((e for e in entries if e.name != protect), key=order)
    out: list[Entry] = []
    if tenant_share >= 1.0:
        for victim in pool:
            if total <= limit:
                break
            out.append(victim)
            total -= victim.size
        return out
    share = tenant_share * limit
    held: dict[str | None, int] = {}
    for e in entries:
        held[e.tenant] = held.get(e.tenant, 0) + e.size
    queues: dict[str | None, deque[Entry]] = {}
    for e in pool:  # each tenant's entries, in eviction order
        queues.setdefault(e.tenant, deque()).append(e)

    def pick(t: str | None) -> tuple[bool, bool, tuple[bool, float, int, int]]:
        head = order(queues[t][0])
        return (head[0], held[t] <= share, head)

    while total > limit and queues:
        tenant = min(queues, key=pick)
        victim = queues[tenant].popleft()
        if not queues[tenant]:
            del queues[tenant]
        out.append(victim)
        total -= victim.size
        held[tenant] -= victim.size
    return out


def tenant_usage(held: Iterable[tuple[str | None, int, int]]) -> dict[str, dict[str, int]]:
    """Bytes and checkpoints per tenant, by name, of (namespace, bytes,
    files) triples (``StoreIndex.namespace_usage``, or one per file): the
    tenants :func:`plan_eviction` counts shares of (the default namespace's
    files are the anonymous tenant's, as its salted ones are; a tenant is a
    name, never a key)."""
    out: dict[str, dict[str, int]] = {}
    for ns, size, files in held:
        t = out.setdefault(tenant_of_namespace(ns) or ANONYMOUS, {"bytes": 0, "checkpoints": 0})
        t["bytes"] += size
        t["checkpoints"] += files
    return dict(sorted(out.items()))


_FP_RE = re.compile(r"(?:^| )model=sha256:([0-9a-f]{16})(?: |$)")
_ARCH_RE = re.compile(r"(?:^| )arch=(\S+)")


def model_of(abi: str) -> str | None:
    """The model fingerprint a payload ABI records (``model=sha256:<16
    hex>``: the GGUF file's SHA-256 for llama.cpp, the weights' for the
    reference engine), or None (a v1 file, another engine's ABI)."""
    m = _FP_RE.search(abi)
    return m.group(1) if m else None


def model_label(abi: str) -> str:
    """``<arch> <fingerprint, 12 digits>`` (``?`` where the ABI names none)."""
    fp = model_of(abi)
    if fp is None:
        return "?"
    arch = _ARCH_RE.search(abi)
    return f"{arch.group(1)} {fp[:12]}" if arch else fp[:12]


def model_usage(held: Iterable[tuple[str, int, int, int]]) -> dict[str, dict[str, object]]:
    """Bytes, checkpoints and hits per model, by fingerprint (``other``: an
    ABI that names none), of (ABI, bytes, files, hits) tuples
    (``StoreIndex.abi_usage``): one model's quantizations and layouts are
    its files too only when their fingerprints agree, so each GGUF file is
    one model here."""
    out: dict[str, dict[str, object]] = {}
    for abi, size, files, hits in held:
        fp = model_of(abi) or "other"
        m = out.setdefault(fp, {"label": model_label(abi), "bytes": 0, "checkpoints": 0, "hits": 0})
        for k, v in (("bytes", size), ("checkpoints", files), ("hits", hits)):
            m[k] = int(m[k]) + v  # type: ignore[call-overload]
    return dict(sorted(out.items()))
