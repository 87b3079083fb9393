"""Checkpoint file names as the store writes them (docs/FORMAT.md, "File
names"): ``<SHA-1 of the key text>-<model tag of the payload ABI>.kv``."""

from __future__ import annotations

import os

from ds4 import _core
from ds4.kvstore import checkpoint_name


def stored_name(text: bytes | str, abi: str) -> str:
    """The name a checkpoint of key text ``text`` written by an engine of
    payload ABI ``abi`` gets."""
    b = text.encode() if isinstance(text, str) else bytes(text)
    return checkpoint_name(_core.sha1_hex(b), abi)


def stored_path(directory: str | os.PathLike[str], text: bytes | str, abi: str) -> str:
    """:func:`stored_name` in ``directory``."""
    return os.path.join(os.fspath(directory), stored_name(text, abi))
