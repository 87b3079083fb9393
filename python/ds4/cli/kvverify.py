"""``ds4 kv verify``: the whole verification pipeline on every file of a
directory (or the names given, or one file), as a load runs it; a
manifest's blocks are verified as a load verifies them (:mod:`.kvblocks`),
and, for a whole directory, every block file of ``blocks/`` on its own,
those no manifest names reported as orphans (``kv gc`` removes them; an
orphan is not a failure). Changes nothing."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..kvstore import scan_dir
from .kvblocks import MANIFEST_KEYS, annotate
from .kvinfo import Info, inspect_file, resolve
from .term import EXIT_FAIL, EXIT_OK, EXIT_USAGE, escaped, human_bytes, json_text

__all__ = ["IGNORED_CODES", "kv_verify"]


def _named_paths(d: str, names: list[str], cmd: str) -> list[str] | None:
    paths = []
    for n in names:
        p, why = resolve(d, n)
        if p is None:
            print(f"ds4 kv {cmd}: {why}", file=sys.stderr)
            return None
        paths.append(p)
    return paths


def _verify_paths(args: argparse.Namespace) -> list[str] | None:
    """The files ``kv verify`` checks: the one file given, the names given
    in the directory, or every checkpoint of it."""
    d = args.dir
    if os.path.isfile(d):
        if args.names:
            print("ds4 kv verify: names are looked up in a directory, not in a file", file=sys.stderr)
            return None
        return [d]
    if args.names:
        return _named_paths(d, args.names, "verify")
    cks, _, other = scan_dir(d)
    return cks + other


#: the codes of a file every path of the store rightly ignores: a ds4 v1
#: file ds4's own reader skips (its quantization, no tokens), kept as ds4 keeps it
IGNORED_CODES = ("v1_ignored",)


def _ignored(r: dict[str, object]) -> bool:
    """A result ``kv verify`` reports as ignored, not failed: an entry that
    is not a regular file (never loaded, moved or deleted) or a file of
    :data:`IGNORED_CODES`; neither is a failure of the directory."""
    return r.get("status") == "ignored" or (not r["ok"] and r.get("code") in IGNORED_CODES)


def _result(i: Info) -> Info:
    return {
        "name": i["name"],
        "ok": i["status"] == "ok",
        "version": i.get("version"),
        "tokens": i.get("tokens"),
        "size": i.get("size"),
        **{k: i[k] for k in MANIFEST_KEYS if k in i},
        **({"status": i["status"], **i["error"]} if i["status"] != "ok" else {}),
    }


def _print_blocks(blocks: list[Info]) -> None:
    for b in blocks:  # the bad and the orphans, one line each: a good named block says nothing
        h = b["name"][:16]
        damage = f"{b['stage']}/{b['code']}: {escaped(b['reason'])}" if not b["ok"] else ""
        if b["orphan"]:
            print(f"ORPHAN block {h}  {human_bytes(b['size'])}, no manifest names it" + (f"; {damage}" * bool(damage)))
        elif damage:
            print(f"FAIL  block {h}  {damage}")


def kv_verify(args: argparse.Namespace) -> int:
    d = args.dir
    if not os.path.isfile(d) and not os.path.isdir(d):
        print(f"ds4 kv: {d}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    paths = _verify_paths(args)
    if paths is None:
        return EXIT_FAIL
    t0 = time.perf_counter()
    infos = [inspect_file(p, full=True) for p in paths]
    whole = os.path.isdir(d) and not args.names
    m = annotate(infos, d if os.path.isdir(d) else os.path.dirname(os.path.abspath(d)), True, whole)
    results = [_result(i) for i in infos]
    blocks = m.check_files() if whole else []  # every block file, for a whole directory only
    ignored = [r for r in results if _ignored(r)]
    bad = [r for r in results if not r["ok"] and not _ignored(r)]
    bad_blocks = [b for b in blocks if not b["ok"] and not b["orphan"]]
    orphans = [b for b in blocks if b["orphan"]]
    good_blocks = len(blocks) - len(bad_blocks) - len(orphans)
    secs = time.perf_counter() - t0
    if args.json:
        out = {
            "dir": os.path.abspath(d),
            "files": results,
            "ok": len(results) - len(bad) - len(ignored),
            "failed": len(bad),
            "ignored": len(ignored),
            "blocks": blocks,
            "blocks_ok": good_blocks,
            "blocks_failed": len(bad_blocks),
            "orphan_blocks": len(orphans),
            "seconds": secs,
        }
        print(json_text(out))
        return EXIT_FAIL if bad or bad_blocks else EXIT_OK
    for r in results:  # one line each: every text from the directory escaped
        name = escaped(r["name"])
        if r["ok"]:
            more = f", {r['blocks']} blocks ({human_bytes(r['block_bytes'])})" if "blocks" in r else ""
            print(f"OK    {name}  v{r['version']} tokens={r['tokens']} {human_bytes(r['size'] or 0)}{more}")
        elif _ignored(r):
            print(f"SKIP  {name}  {escaped(r['reason'])}")
        else:
            print(f"FAIL  {name}  {r['status']} {r['stage']}/{r['code']}: {escaped(r['reason'])}")
    _print_blocks(blocks)
    line = f"{len(results) - len(bad) - len(ignored)} ok, {len(bad)} failed, {len(ignored)} ignored"
    if blocks:
        line += f"; blocks: {good_blocks} ok, {len(bad_blocks)} failed, {len(orphans)} orphans"
    print(f"{line} ({secs:.2f} s)")
    return EXIT_FAIL if bad or bad_blocks else EXIT_OK
