"""``ds4 kv rm`` and ``ds4 kv prune``: checkpoints removed by name, or one
model's (:mod:`.kvmodels`), by :class:`ds4.KVStore` under the directory's
lock; never an entry that is not a regular file."""

from __future__ import annotations

import argparse
import os
import sys

from ..kvstore import KVStore, is_regular, scan_dir
from .kvinfo import inspect_file, resolve
from .kvmodels import model_filter, of_model
from .term import EXIT_USAGE, report_removed

__all__ = ["kv_prune", "kv_rm"]


def _not_a_dir(d: str, cmd: str) -> bool:
    if os.path.isdir(d):
        return False
    print(f"{cmd}: {d}: not a directory", file=sys.stderr)
    return True


def kv_rm(args: argparse.Namespace) -> int:
    d = args.dir
    if _not_a_dir(d, "ds4 kv rm"):
        return EXIT_USAGE
    errors: list[str] = []
    if args.all:
        targets = scan_dir(d)[0]
    elif not args.names:
        print("ds4 kv rm: give checkpoint names (or unique prefixes), or --all", file=sys.stderr)
        return EXIT_USAGE
    else:
        targets = []
        for n in args.names:
            p, why = resolve(d, n)
            if p is None:
                errors.append(str(why))
            else:
                targets.append(p)
    store = KVStore(d, scan=False, trust_dir=True)  # an explicit removal in a named directory
    removed = []
    for p in targets:
        if os.path.lexists(p) and not is_regular(p):
            errors.append(f"{os.path.basename(p)}: not a regular file (ignored, never removed)")
            continue
        try:
            if store.remove(p):
                removed.append(os.path.basename(p))
            else:
                errors.append(f"{os.path.basename(p)}: already gone")
        except ValueError as e:
            errors.append(str(e))
    return report_removed(args.json, removed, "errors", errors, "ds4 kv rm")


def kv_prune(args: argparse.Namespace) -> int:
    """``ds4 kv prune DIR --model PATH``: remove that model's checkpoints
    (by the fingerprint their ABI records), nothing else, under the store's
    lock; ``--dry-run`` lists them."""
    d = args.dir
    if _not_a_dir(d, "ds4 kv prune"):
        return EXIT_USAGE
    fp = model_filter(args, "ds4 kv prune")
    if not fp:
        if fp is None:
            print("ds4 kv prune: give --model PATH (the model whose checkpoints go)", file=sys.stderr)
        return EXIT_USAGE
    cks, _tmps, _other = scan_dir(d)
    targets = [i["path"] for i in of_model([inspect_file(p) for p in cks], str(fp))]
    if args.dry_run:
        return report_removed(args.json, [os.path.basename(p) for p in targets], "errors", [], "ds4 kv prune")
    store = KVStore(d, scan=False, trust_dir=True)  # an explicit removal in a named directory
    removed, errors = [], []
    for p in targets:
        if not is_regular(p):
            errors.append(f"{os.path.basename(p)}: not a regular file (ignored, never removed)")
        elif store.remove(p):
            removed.append(os.path.basename(p))
        else:
            errors.append(f"{os.path.basename(p)}: already gone")
    return report_removed(args.json, removed, "errors", errors, "ds4 kv prune")
