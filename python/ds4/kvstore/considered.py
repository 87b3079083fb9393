"""What the ladder reports of a miss (:meth:`ds4.recovery._Ladder.divergence`,
through :meth:`ds4.kvstore.KVStore.longest_considered` and
:meth:`~ds4.kvstore.KVStore.stored_text`):
the longest checkpoint a lookup considered, from the index as it stands, and
its stored text, read and verified (never another namespace's)."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

from ..checkpoint import open_checkpoint
from ..errors import CheckpointError
from ..keytext import namespace_of
from .entries import Candidates, Entry
from .files import is_checkpoint_name
from .parts import StoreParts

log = logging.getLogger("ds4.kvstore")

__all__ = ["longest_considered", "stored_text"]


def longest_considered(
    parts: StoreParts, found: Candidates, *, ctx: int | None = None, exclude: Collection[str] = ()
) -> Entry | None:
    """The longest checkpoint that the lookup of ``found`` considered,
    from the index as it stands (call it right after the lookup: no
    rescan, no file read, nothing hashed): a file of this directory in
    ``found``'s namespace whose text is no longer than the prompt, of at
    least ``min_tokens`` tokens and fewer than ``ctx`` (the lookup's own
    filters, before it compares tails and hashes), the lookup's order
    breaking ties. It need not be a prefix of the prompt: where the
    prompt leaves it is what the ladder reports (its ``divergence``;
    :meth:`stored_text` reads its text). Names in ``exclude`` are left
    out. One call into the core (``StoreIndex.longest``: the length-sorted
    table walked down to the first file of the namespace)."""
    row = parts.index.longest(
        len(found.prompt), found.namespace, min_tokens=max(0, parts.policy.min_tokens), ctx=ctx, exclude=list(exclude)
    )
    return None if row is None else Entry.from_row(parts.dir, row)


def stored_text(parts: StoreParts, entry: Entry, namespace: str | None) -> bytes | None:
    """The stored key text of ``entry`` when it is in ``namespace``:
    its header and text read and verified
    (:func:`ds4.checkpoint.open_checkpoint` without the payload; with
    this store's key, a file without a MAC is refused). None when it
    cannot be read or its text does not start with the namespace's own
    preamble (never another namespace's text)."""
    if not is_checkpoint_name(entry.name):
        return None
    try:
        ck = open_checkpoint(os.path.join(parts.dir, entry.name), load_payload=False, auth_key=parts.auth_key)
        text = bytes(ck.text)
    except (OSError, CheckpointError) as e:
        log.debug("kv cache could not read the text of %s: %s", entry.name, e)
        return None
    try:
        same = namespace_of(text)[0] == namespace
    except ValueError:
        same = False
    return text if same else None
