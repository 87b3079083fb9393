"""``ds4 kv lookup DIR PROMPT_FILE``: the longest stored prefix of a prompt,
found as a turn finds it (:meth:`ds4.kvstore.KVStore.candidates`, the
store's index). The file's bytes are the key text looked up as they are
(a checkpoint's stored text: a prompt rendered with its markers as their
text, without a namespace preamble, as ``ds4 kv show --text`` prints one).
Exit 0 on a hit, 1 on a miss, 2 for a missing directory or prompt file.

It imports the store and nothing of the engines, the turn driver or the
server (``tests/test_cli.py`` holds it to that)."""

from __future__ import annotations

import argparse
import os
import sys

from ..kvstore import KVStore
from .term import EXIT_FAIL, EXIT_OK, EXIT_USAGE, escaped, json_text

__all__ = ["kv_lookup"]

#: the store's budget here: large enough that opening never evicts
_NO_EVICTION_MB = float(1 << 30)


def _read_prompt(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        print(f"ds4 kv lookup: {path}: cannot read the prompt file: {e.strerror}", file=sys.stderr)
        return None


def kv_lookup(args: argparse.Namespace) -> int:
    d = args.dir
    if not os.path.isdir(d):
        print(f"ds4 kv lookup: {d}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    prompt = _read_prompt(args.prompt_file)
    if prompt is None:
        return EXIT_USAGE
    # an explicit look at a named directory (as kv gc and rm): its index is
    # read (and written back when stale), nothing is evicted or loaded
    store = KVStore(d, budget_mb=_NO_EVICTION_MB, min_tokens=1, trust_dir=True)
    entries = store.candidates(prompt).entries
    best = entries[0] if entries else None
    out = {
        "dir": os.path.abspath(d),
        "prompt_bytes": len(prompt),
        "hit": best is not None,
        "name": best.name if best else None,
        "tokens": best.tokens if best else None,
        "text_bytes": best.text_bytes if best else None,
        "reason": best.reason if best else None,
    }
    if args.json:
        print(json_text(out))
    elif best is None:
        print(f"miss: no stored prefix of the {len(prompt)}-byte prompt")
    else:
        print(
            f"hit {escaped(best.name)} tokens={best.tokens} text_bytes={best.text_bytes} reason={escaped(best.reason)}"
        )
    return EXIT_OK if best is not None else EXIT_FAIL
