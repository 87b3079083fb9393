"""The shared tier's layout: what its URLs look like, what its Redis keys
are named, and what a checkpoint's manifest holds. No Redis client here:
:mod:`.remote` does the I/O through these names.

Key layout (every key of one checkpoint shares one hash tag, so a cluster
keeps them on one node and a commit is one transaction)::

    ds4:{<namespace>/<abi id>/<sha1>}:m      the manifest (JSON: header facts, size,
                                             XXH3-128 of each chunk), written last
    ds4:{<namespace>/<abi id>/<sha1>}:c:<i>  payload chunk i (<= 8 MiB)
    ds4:{<namespace>/<abi id>/<sha1>}:u      an uploader's claim (expires)
    ds4:{<namespace>/<abi id>}:idx           per-ABI index: sorted set of
                                             "<text bytes>:<sha1>", score = text bytes
    ds4:{<namespace>/<abi id>/<block>}:b     a shared block's record (JSON: its size,
                                             XXH3-128 of each chunk, when stored), written last
    ds4:{<namespace>/<abi id>/<block>}:c:<i> the block file's chunk i

``<block>`` is a block's name (64 hex digits, docs/FORMAT.md §7): a
checkpoint written as a manifest is stored as any other (its file's
chunks), and its manifest here lists its blocks (``blocks``), each stored
once for every checkpoint that names it.

``<abi id>`` is the first 16 hex digits of SHA-1 of the payload ABI string;
``<namespace>`` separates whatever must never share checkpoints (tenants:
the default namespace is ``shared``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from typing import Any

from .. import _core
from ..errors import RemoteManifestError

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_NAMESPACE",
    "HEADER_BYTES",
    "MANIFEST_MAX_BYTES",
    "MANIFEST_VERSION",
    "SCHEMES",
    "BlockRecord",
    "KeyLayout",
    "RemoteEntry",
    "chunk_digest",
    "is_block",
    "is_sha",
    "parse_remote_url",
    "redact_url",
]

#: the largest payload chunk (Redis's value limit is 512 MiB; large values
#: block the server's one thread)
CHUNK_BYTES = 8 * 2**20
#: a manifest larger than this is not one ds4 wrote (a 1 TiB checkpoint
#: has 131,072 chunks: about 4.5 MiB of digests)
MANIFEST_MAX_BYTES = 8 * 2**20
MANIFEST_VERSION = 1
#: the fixed header of a v2 checkpoint file (docs/FORMAT.md §1.2): what a
#: manifest's facts are checked against
HEADER_BYTES = 96
SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
DEFAULT_NAMESPACE = "shared"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")
_BLOCK_RE = re.compile(r"^[0-9a-f]{64}$")
#: the most blocks one manifest lists (a 1M-token state in blocks of 16)
MAX_BLOCKS = 65536


def parse_remote_url(url: str) -> tuple[bool, str]:
    """(is a cluster, the URL for the redis client) of a ``--kv-remote``
    URL: ``redis://host:port/db``, ``rediss://`` (TLS), or
    ``redis+cluster://host:port`` (any node of a cluster; ``rediss+cluster``
    with TLS). A bad URL is a ``ValueError``."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in SCHEMES:
        raise ValueError(f"--kv-remote must be a redis://, rediss:// or redis+cluster:// URL, not {redact_url(url)!r}")
    try:
        port = u.port
    except ValueError as e:
        raise ValueError(f"bad port in {redact_url(url)!r}") from e
    if not u.hostname or port == 0:
        raise ValueError(f"no host in {redact_url(url)!r}")
    cluster = u.scheme.endswith("+cluster")
    if cluster and u.path not in ("", "/", "/0"):
        raise ValueError("a Redis Cluster has one database: no /db in a redis+cluster:// URL")
    if not cluster and u.path not in ("", "/") and not u.path.lstrip("/").isdigit():
        raise ValueError(f"the database in {redact_url(url)!r} must be a number")
    scheme = u.scheme.split("+")[0]
    return cluster, urllib.parse.urlunsplit((scheme, u.netloc, u.path, u.query, ""))


def redact_url(url: str) -> str:
    """The URL without its password (what logs and ``/health`` show)."""
    u = urllib.parse.urlsplit(url)
    if u.password is None:
        return url
    host = u.hostname or ""
    netloc = f"{u.username or ''}:***@{host}" + (f":{u.port}" if u.port else "")
    return urllib.parse.urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


class KeyLayout:
    """The keys of one namespace and payload ABI (see the module doc).

    ``namespace`` is where a tenant's separation goes: checkpoints stored
    under one namespace are never candidates in another."""

    def __init__(self, namespace: str, abi: str):
        if not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"a remote namespace is 1-64 of [A-Za-z0-9._-], not {namespace!r}")
        self.namespace = namespace
        self.abi = abi
        self.abi_id = abi_id(abi)
        self.index = f"ds4:{{{namespace}/{self.abi_id}}}:idx"

    def tag(self, sha: str) -> str:
        return f"ds4:{{{self.namespace}/{self.abi_id}/{sha}}}"

    def manifest(self, sha: str) -> str:
        return self.tag(sha) + ":m"

    def chunk(self, sha: str, i: int) -> str:
        return f"{self.tag(sha)}:c:{i}"

    def claim(self, sha: str) -> str:
        return self.tag(sha) + ":u"

    def block(self, name: str) -> str:
        """A shared block's record (its chunks are :meth:`chunk` of its name)."""
        return self.tag(name) + ":b"

    @staticmethod
    def member(text_bytes: int, sha: str) -> str:
        return f"{text_bytes}:{sha}"

    @classmethod
    def of_index(cls, namespace: str, index: str) -> KeyLayout:
        """The layout of an index key a scan found (``ds4:{<namespace>/<abi
        id>}:idx``): its ABI is known by its id only."""
        keys = cls(namespace, "")
        keys.abi_id = index.split("/", 1)[1].split("}", 1)[0]
        keys.index = index
        return keys

    @classmethod
    def of_abi_id(cls, namespace: str, abi_id: str) -> KeyLayout:
        """The layout of an ABI known by its id only (a block a scan found)."""
        keys = cls(namespace, "")
        keys.abi_id = abi_id
        keys.index = f"ds4:{{{namespace}/{abi_id}}}:idx"
        return keys

    @staticmethod
    def index_pattern(namespace: str) -> str:
        """The ``SCAN`` pattern of every per-ABI index of ``namespace``."""
        return f"ds4:{{{namespace}/*}}:idx"


def is_block(s: str) -> bool:
    """``s`` is a block's name (64 lowercase hex digits)."""
    return _BLOCK_RE.match(s) is not None


def is_sha(s: str) -> bool:
    """``s`` is a key's SHA-1 (40 lowercase hex digits), as an index member carries it."""
    return _SHA_RE.match(s) is not None


def chunk_digest(data: bytes | memoryview) -> str:
    """A chunk's digest in the manifest: XXH3-128, hex (finds damage in
    transit or in Redis early and names the chunk; what makes a download
    trusted is the whole pipeline that runs on the file afterwards).
    ``xxhash`` comes with ``ds4[redis]``; ds4 without a tier never imports it."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def _nonneg_int(d: dict[str, Any], key: str, limit: int = 2**62) -> int:
    v = d.get(key)
    if type(v) is not int or not 0 <= v <= limit:
        raise RemoteManifestError(f"manifest field {key!r} is not an integer in range")
    return v


def abi_id(abi: str) -> str:
    """The first 16 hex digits of the SHA-1 of a payload ABI: its keys' part,
    and the model tag of a directory's per-model file names (one function:
    ``_core.model_tag``)."""
    return _core.model_tag(abi)


def _json_v1(raw: bytes, what: str) -> dict[str, Any]:
    """A manifest's or block record's JSON object, of version 1 and at most
    :data:`MANIFEST_MAX_BYTES` (:class:`RemoteManifestError` otherwise)."""
    if len(raw) > MANIFEST_MAX_BYTES:
        raise RemoteManifestError(f"{what} of {len(raw)} bytes")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RemoteManifestError(f"{what} is not JSON: {e}") from None
    if not isinstance(d, dict) or d.get("v") != MANIFEST_VERSION:
        raise RemoteManifestError(f"{what} is not a version 1 object")
    return d


def _chunked(d: dict[str, Any], what: str) -> tuple[int, int, tuple[str, ...]]:
    """(size, chunk bytes, chunk digests) of a manifest or block record,
    each checked: a payload, chunks of at most :data:`CHUNK_BYTES`, one
    well-formed digest per chunk."""
    size = _nonneg_int(d, "size")
    chunk_bytes = _nonneg_int(d, "chunk_bytes", CHUNK_BYTES)
    chunks = d.get("chunks")
    if size == 0 or chunk_bytes == 0 or not isinstance(chunks, list):
        raise RemoteManifestError(f"{what} has no payload")
    if chunk_bytes > CHUNK_BYTES:  # no writer makes them; a download holds a few
        raise RemoteManifestError(f"{what}'s chunks of {chunk_bytes} bytes (at most {CHUNK_BYTES})")
    if len(chunks) != -(-size // chunk_bytes) or not all(isinstance(c, str) and _DIGEST_RE.match(c) for c in chunks):
        raise RemoteManifestError(f"{what}'s chunk list does not match its size")
    return size, chunk_bytes, tuple(chunks)


@dataclasses.dataclass(frozen=True)
class BlockRecord:
    """One shared block in the tier: its file's size and chunks' digests,
    and when it was stored (``gc`` leaves a young block no manifest names
    yet: its checkpoint's upload may be under way)."""

    name: str
    size: int
    chunk_bytes: int
    digests: tuple[str, ...]
    stored_at: int = 0

    @property
    def sha(self) -> str:  # the tag its chunks are under (:meth:`KeyLayout.chunk`)
        return self.name

    def chunk_len(self, i: int) -> int:
        return min(self.chunk_bytes, self.size - i * self.chunk_bytes)

    def to_bytes(self) -> bytes:
        d: dict[str, Any] = {"v": MANIFEST_VERSION, "block": self.name, "size": self.size}
        d.update(chunk_bytes=self.chunk_bytes, chunks=list(self.digests), t=self.stored_at)
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode("ascii")

    @classmethod
    def from_bytes(cls, raw: bytes, name: str) -> BlockRecord:
        """The record stored under block ``name``'s key, every field checked
        (:class:`RemoteManifestError` otherwise)."""
        d = _json_v1(raw, "block record")
        if d.get("block") != name:
            raise RemoteManifestError("block record names another block than its key")
        size, chunk_bytes, chunks = _chunked(d, "block record")
        return cls(name, size, chunk_bytes, chunks, _nonneg_int(d, "t"))


@dataclasses.dataclass(frozen=True)
class RemoteEntry:
    """One remote checkpoint, as its manifest describes it: the header
    facts a lookup needs, and the size and digest of every chunk."""

    sha: str
    abi: str
    tokens: int
    text_bytes: int
    size: int
    chunk_bytes: int
    digests: tuple[str, ...]
    #: the blocks its file's table names (a manifest: docs/FORMAT.md §7), as
    #: its uploader listed them: what a hit refreshes and ``gc`` keeps; a
    #: download fetches what the verified file's own table names
    blocks: tuple[str, ...] = ()
    #: the manifest's bytes as Redis held them (empty for one built here): a
    #: rejection deletes the entry only while Redis still holds these bytes
    raw: bytes = dataclasses.field(default=b"", compare=False, repr=False)

    @property
    def name(self) -> str:
        """The file it becomes in a directory: its model's per-model name
        (``<sha1>-<abi id>.kv``, the tag is the key's ABI id)."""
        return f"{self.sha}-{abi_id(self.abi)}.kv"

    def chunk_len(self, i: int) -> int:
        return min(self.chunk_bytes, self.size - i * self.chunk_bytes)

    def to_bytes(self) -> bytes:
        d: dict[str, Any] = {
            "v": MANIFEST_VERSION,
            "sha1": self.sha,
            "abi": self.abi,
            "tokens": self.tokens,
            "text_bytes": self.text_bytes,
            "size": self.size,
            "chunk_bytes": self.chunk_bytes,
            "chunks": list(self.digests),
        }
        if self.blocks:  # absent for a single file: a release before blocks reads the manifest as it did
            d["blocks"] = list(self.blocks)
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode("ascii")

    @classmethod
    def from_bytes(cls, raw: bytes, sha: str, abi: str) -> RemoteEntry:
        """The manifest stored under ``sha``'s key for ``abi``: every field
        checked (types, ranges, the chunk count against the size) before
        anything uses it; :class:`RemoteManifestError` otherwise."""
        d = _json_v1(raw, "manifest")
        if d.get("sha1") != sha or d.get("abi") != abi:
            raise RemoteManifestError("manifest names another checkpoint or ABI than its key")
        size, chunk_bytes, chunks = _chunked(d, "manifest")
        blocks = d.get("blocks", [])
        if (
            not isinstance(blocks, list)
            or len(blocks) > MAX_BLOCKS
            or not all(isinstance(b, str) and is_block(b) for b in blocks)
        ):
            raise RemoteManifestError("manifest's block list is not a list of block names")
        text_bytes = _nonneg_int(d, "text_bytes", size)
        tokens = _nonneg_int(d, "tokens")
        return cls(sha, abi, tokens, text_bytes, size, chunk_bytes, chunks, tuple(blocks), bytes(raw))

    @classmethod
    def describes(cls, raw: bytes, sha: str, abi: str, facts: tuple[int, int, int]) -> bool:
        """The manifest ``raw`` parses and describes a file of these (size,
        tokens, text bytes): what an upload finding a manifest asks."""
        try:
            e = cls.from_bytes(raw, sha, abi)
        except RemoteManifestError:
            return False
        return (e.size, e.tokens, e.text_bytes) == facts

    def check_header(self, head: bytes) -> None:
        """:class:`RemoteManifestError` when ``head`` (the first
        :data:`HEADER_BYTES` of the file, from chunk 0) is not a v2 header
        of the checkpoint this manifest describes: its tokens, text length
        or text SHA-1 differ (a manifest that lies about what it holds), or
        there is no header at all. A header of another version passes (a
        newer ds4's file: the pipeline judges it)."""
        if len(head) < HEADER_BYTES or head[:3] != b"KVC":
            raise RemoteManifestError("the checkpoint's first chunk holds no header")
        if head[3] != 2:
            return
        tokens = int.from_bytes(head[8:12], "little")
        text_bytes = int.from_bytes(head[48:52], "little")
        if tokens != self.tokens or text_bytes != self.text_bytes or head[56:76].hex() != self.sha:
            raise RemoteManifestError(
                f"the manifest claims {self.tokens} tokens and {self.text_bytes} text bytes, "
                f"the file's header {tokens} and {text_bytes}"
            )
