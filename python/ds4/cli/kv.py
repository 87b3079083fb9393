"""``ds4 kv``: inspect, verify and clean a checkpoint directory (ds4's v1
files too: every file goes through :func:`ds4.open_checkpoint`, which reads
both formats). What is removed is removed by :class:`ds4.KVStore`, under
the directory's lock; the inspection commands change nothing."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ..checkpoint import open_checkpoint
from ..errors import CheckpointError
from ..kvstore import Entry, KVStore, plan_eviction, remove_orphaned_temp, scan_dir, temp_is_orphaned
from .term import EXIT_FAIL, EXIT_OK, EXIT_USAGE, age, human_bytes, preview, printable, table

__all__ = ["KV_COMMANDS", "inspect_file"]

Info = dict[str, Any]


def inspect_file(path: str, full: bool = False) -> Info:
    """Facts about one checkpoint file; ``full`` runs the whole pipeline
    (payload checksum for v2, DSV4 decode for v1)."""
    info: Info = {"name": os.path.basename(path), "path": path}
    try:
        st = os.stat(path, follow_symlinks=False)
        info["size"] = st.st_size
        ck = open_checkpoint(path, load_payload=full, verify_checksum=full, mmap=False)
    except CheckpointError as e:
        info.update(status=e.kind, error={"stage": e.stage, "code": e.code, "reason": e.reason}, _error=e)
        return info
    except OSError as e:
        info.update(status="error", error={"stage": "open", "code": "os_error", "reason": str(e)})
        return info
    info.update(
        status="ok",
        version=ck.version,
        reason=ck.reason_name,
        tokens=ck.tokens,
        text_bytes=ck.text_bytes,
        hits=ck.hits,
        ctx=ck.ctx,
        quant_bits=ck.quant_bits,
        flags=ck.flags,
        created=ck.created,
        last_used=ck.last_used,
        payload_bytes=ck.payload_bytes,
        trailer_bytes=ck.trailer_bytes,
        abi=ck.abi if ck.version >= 2 else "ds4 v1 (DSV4 payload)",
        preview=preview(ck.text),
    )
    if ck.version >= 2:
        info["tensors"] = [
            {"name": n, "dtype": dt, "shape": list(sh), "offset": off, "bytes": nb}
            for (n, dt, sh, off, nb) in ck.tensor_table()
        ]
        info["payload_checksum"] = f"{ck.payload_checksum:016x}"
        info["header_checksum"] = f"{ck.header_checksum:016x}"
    else:
        info["dsv4"] = dict(ck.dsv4) if ck.dsv4 else None
    info["_text"] = ck.text
    info["_entry"] = Entry.from_checkpoint(ck, path)
    return info


def _public(info: Info) -> Info:
    return {k: v for k, v in info.items() if not k.startswith("_")}


def _resolve(d: str, name: str) -> tuple[str | None, str | None]:
    """A checkpoint path in ``d`` by file name or unique hex prefix."""
    if os.sep in name and os.path.exists(name):
        return name, None
    cks, _, other = scan_dir(d)
    cands = [p for p in cks + other if os.path.basename(p) in (name, name + ".kv")]
    if cands:
        return cands[0], None
    hits = [p for p in cks if os.path.basename(p).startswith(name.lower())] if name else []
    if len(hits) == 1:
        return hits[0], None
    return None, ("no checkpoint matches" if not hits else f"ambiguous ({len(hits)} files match)") + f" {name!r}"


def _not_a_dir(d: str) -> bool:
    """True (after saying so on stderr) when ``d`` is not a directory."""
    if os.path.isdir(d):
        return False
    print(f"ds4 kv: {d}: not a directory", file=sys.stderr)
    return True


def _ls_row(i: Info, now: float) -> list[str]:
    if i["status"] == "ok":
        return [
            i["name"][:12],
            f"v{i['version']}",
            i["reason"],
            str(i["tokens"]),
            human_bytes(i["size"]),
            str(i["hits"]),
            age(i["last_used"] or i["created"], now),
            "ok",
            i["preview"],
        ]
    err = i["error"]
    return [
        i["name"][:12],
        "?",
        "?",
        "?",
        human_bytes(i.get("size", 0)),
        "?",
        "?",
        f"{i['status']}:{err['code']}",
        printable(err["reason"])[:48],
    ]


def kv_ls(args: argparse.Namespace) -> int:
    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    cks, tmps, other = scan_dir(d)
    infos = [inspect_file(p) for p in cks + other]
    infos.sort(key=lambda i: (-(i.get("last_used") or 0), i["name"]))
    if args.json:
        files = [_public(i) for i in infos]
        print(
            json.dumps(
                {"dir": os.path.abspath(d), "files": files, "temp_files": [os.path.basename(t) for t in tmps]}, indent=1
            )
        )
        return EXIT_OK
    now = time.time()
    rows = [_ls_row(i, now) for i in infos]
    table(rows, ["NAME", "VER", "REASON", "TOKENS", "SIZE", "HITS", "LAST USED", "STATUS", "TEXT"], sys.stdout)
    total = sum(i.get("size", 0) for i in infos)
    print(f"{len(infos)} files, {human_bytes(total)}" + (f", {len(tmps)} temp files" if tmps else ""))
    return EXIT_OK


_SHOW_KEYS = (
    "name",
    "path",
    "status",
    "version",
    "reason",
    "tokens",
    "text_bytes",
    "size",
    "hits",
    "ctx",
    "quant_bits",
    "flags",
    "created",
    "last_used",
    "payload_bytes",
    "trailer_bytes",
    "abi",
    "header_checksum",
    "payload_checksum",
)


def _show_path(args: argparse.Namespace) -> tuple[str | None, int]:
    d = args.dir
    if os.path.isfile(d) and not args.name:
        return d, EXIT_OK
    if _not_a_dir(d):
        return None, EXIT_USAGE
    if not args.name:
        print("ds4 kv show: give a checkpoint name (or a unique prefix)", file=sys.stderr)
        return None, EXIT_USAGE
    path, why = _resolve(d, args.name)
    if path is None:
        print(f"ds4 kv show: {why}", file=sys.stderr)
        return None, EXIT_FAIL
    return path, EXIT_OK


def _print_fields(info: Info) -> None:
    for k in _SHOW_KEYS:
        if k not in info:
            continue
        v = info[k]
        if k in ("created", "last_used") and v:
            v = f"{v} ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(v))}, {age(v)})"
        elif k == "size":
            v = f"{v} ({human_bytes(v)})"
        print(f"{k:16} {v}")
    if info.get("error"):
        er = info["error"]
        print(f"{'error':16} {er['stage']}/{er['code']}: {er['reason']}")
    if info.get("dsv4"):
        print("DSV4 payload header:")
        for k, v in info["dsv4"].items():
            print(f"  {k:14} {hex(v) if k == 'magic' else v}")
    if info.get("tensors"):
        print("tensors:")
        rows = [
            [
                "  " + t["name"],
                t["dtype"],
                "x".join(map(str, t["shape"])) or "()",
                str(t["offset"]),
                human_bytes(t["bytes"]),
            ]
            for t in info["tensors"]
        ]
        table(rows, ["  NAME", "DTYPE", "SHAPE", "OFFSET", "BYTES"], sys.stdout)


def kv_show(args: argparse.Namespace) -> int:
    path, rc = _show_path(args)
    if path is None:
        return rc
    info = inspect_file(path, full=args.verify)
    text = info.pop("_text", None)
    status = EXIT_OK if info["status"] == "ok" else EXIT_FAIL
    if args.json:
        out = _public(info)
        if text is not None:
            out["text"] = text.decode("utf-8", "replace")
        print(json.dumps(out, indent=1, ensure_ascii=False))
        return status
    _print_fields(info)
    if text is not None:
        s = text.decode("utf-8", "replace")
        if not args.text and len(s) > 400:
            s = s[:200] + f"\n… ({len(text)} bytes; --text shows all) …\n" + s[-200:]
        print("text:")
        print(printable(s))
    return status


def _named_paths(d: str, names: list[str], cmd: str) -> list[str] | None:
    paths = []
    for n in names:
        p, why = _resolve(d, n)
        if p is None:
            print(f"ds4 kv {cmd}: {why}", file=sys.stderr)
            return None
        paths.append(p)
    return paths


def kv_verify(args: argparse.Namespace) -> int:
    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    if args.names:
        paths = _named_paths(d, args.names, "verify")
        if paths is None:
            return EXIT_FAIL
    else:
        cks, _, other = scan_dir(d)
        paths = cks + other
    t0 = time.perf_counter()
    results = []
    for p in paths:
        i = inspect_file(p, full=True)
        results.append(
            {
                "name": i["name"],
                "ok": i["status"] == "ok",
                "version": i.get("version"),
                "tokens": i.get("tokens"),
                "size": i.get("size"),
                **({"status": i["status"], **i["error"]} if i["status"] != "ok" else {}),
            }
        )
    bad = [r for r in results if not r["ok"]]
    secs = time.perf_counter() - t0
    if args.json:
        out = {
            "dir": os.path.abspath(d),
            "files": results,
            "ok": len(results) - len(bad),
            "failed": len(bad),
            "seconds": secs,
        }
        print(json.dumps(out, indent=1))
        return EXIT_FAIL if bad else EXIT_OK
    for r in results:
        if r["ok"]:
            print(f"OK    {r['name']}  v{r['version']} tokens={r['tokens']} {human_bytes(r['size'] or 0)}")
        else:
            print(f"FAIL  {r['name']}  {r['status']} {r['stage']}/{r['code']}: {r['reason']}")
    print(f"{len(results) - len(bad)} ok, {len(bad)} failed ({secs:.2f} s)")
    return EXIT_FAIL if bad else EXIT_OK


def _bytes_of(paths: list[str]) -> int:
    return sum(os.path.getsize(p) for p in paths if os.path.exists(p))


class _Gc:
    """One ``ds4 kv gc`` run: corrupt files out (or quarantined), orphaned
    temp files out, then eviction to a budget, all by the store's policy.
    With ``dry_run`` nothing changes and the same decisions are reported."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.d, self.now = args, args.dir, time.time()
        budget = args.budget_mb if args.budget_mb is not None else 1 << 40
        self.store = KVStore(self.d, budget_mb=budget, min_tokens=1, quarantine_dir=args.quarantine_dir, scan=False)
        self.removed: list[Info] = []
        self.quarantined: list[str] = []
        self.tmp_removed: list[str] = []
        self.evicted: list[str] = []
        self.kept: list[Info] = []

    def corrupt(self, cks: list[str]) -> None:
        for p in cks:
            i = inspect_file(p, full=True)
            if i["status"] == "corrupt":
                if not self.args.dry_run:
                    moved = self.store.discard(p, i["_error"], "gc")
                    if moved is None:
                        continue
                    if self.args.quarantine_dir:
                        self.quarantined.append(i["name"])
                self.removed.append({"name": i["name"], **i["error"]})
            elif i["status"] != "ok":
                self.kept.append({"name": i["name"], "status": i["status"], **i["error"]})

    def temps(self, tmps: list[str]) -> None:
        for t in tmps:
            name = os.path.basename(t)
            if self.args.dry_run:
                try:
                    mtime = os.stat(t, follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                if temp_is_orphaned(name, mtime, self.now, self.args.tmp_age):
                    self.tmp_removed.append(name)
            elif remove_orphaned_temp(t, self.now, self.args.tmp_age):
                self.tmp_removed.append(name)

    def evict(self) -> None:
        if self.args.budget_mb is None:
            return
        if self.args.dry_run:  # the store's policy, without unlinking
            ents = [i["_entry"] for i in (inspect_file(p) for p in scan_dir(self.d)[0]) if i["status"] == "ok"]
            limit = int(self.args.budget_mb * 1024 * 1024)
            self.evicted = [e.name for e in plan_eviction(ents, limit, time.time())]
            return
        names_before = {os.path.basename(p) for p in scan_dir(self.d)[0]}
        self.store.evict()
        self.evicted = sorted(names_before - {os.path.basename(p) for p in scan_dir(self.d)[0]})

    def report(self, before: int, after: int) -> None:
        args = self.args
        out = {
            "dir": os.path.abspath(self.d),
            "dry_run": args.dry_run,
            "removed_corrupt": self.removed,
            "quarantined": self.quarantined,
            "removed_temp": self.tmp_removed,
            "evicted": self.evicted,
            "kept_unusable": self.kept,
            "bytes_before": before,
            "bytes_after": after,
        }
        if args.json:
            print(json.dumps(out, indent=1))
            return
        verb = "would remove" if args.dry_run else "removed"
        for r in self.removed:
            print(f"{verb} corrupt {r['name']}: {r['stage']}/{r['code']}: {r['reason']}")
        for t in self.tmp_removed:
            print(f"{verb} orphaned temp file {t}")
        for n in self.evicted:
            print(f"{'would evict' if args.dry_run else 'evicted'} {n}")
        for k in self.kept:
            print(f"kept {k['name']} ({k['status']}: {k['code']})")
        print(
            f"{len(self.removed)} corrupt, {len(self.tmp_removed)} temp, {len(self.evicted)} evicted; "
            f"{human_bytes(before)} -> {human_bytes(after)}"
        )


def kv_gc(args: argparse.Namespace) -> int:
    if _not_a_dir(args.dir):
        return EXIT_USAGE
    cks, tmps, _ = scan_dir(args.dir)
    before = _bytes_of(cks)
    gc = _Gc(args)
    gc.corrupt(cks)
    gc.temps(tmps)
    gc.evict()
    gc.report(before, _bytes_of(scan_dir(args.dir)[0]))
    return EXIT_OK


def kv_rm(args: argparse.Namespace) -> int:
    d = args.dir
    if _not_a_dir(d):
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
            p, why = _resolve(d, n)
            if p is None:
                errors.append(str(why))
            else:
                targets.append(p)
    store = KVStore(d, scan=False)
    removed = []
    for p in targets:
        try:
            if store.remove(p):
                removed.append(os.path.basename(p))
            else:
                errors.append(f"{os.path.basename(p)}: already gone")
        except ValueError as e:
            errors.append(str(e))
    if args.json:
        print(json.dumps({"removed": removed, "errors": errors}, indent=1))
    else:
        for n in removed:
            print(f"removed {n}")
        for er in errors:
            print(f"ds4 kv rm: {er}", file=sys.stderr)
    return EXIT_FAIL if errors else EXIT_OK


def _counts(infos: list[Info], key: str) -> dict[str, int]:
    return {k: sum(1 for i in infos if str(i[key]) == k) for k in sorted({str(i[key]) for i in infos})}


def kv_stats(args: argparse.Namespace) -> int:
    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    cks, tmps, other = scan_dir(d)
    infos = [inspect_file(p) for p in cks + other]
    ok = [i for i in infos if i["status"] == "ok"]
    bad = [i["status"] for i in infos if i["status"] != "ok"]
    st = {
        "dir": os.path.abspath(d),
        "files": len(infos),
        "ok": len(ok),
        "unusable": {s: bad.count(s) for s in sorted(set(bad))},
        "bytes": sum(i.get("size", 0) for i in infos),
        "tokens": sum(i["tokens"] for i in ok),
        "by_version": _counts(ok, "version"),
        "by_reason": _counts(ok, "reason"),
        "by_abi": _counts(ok, "abi"),
        "hits": sum(i["hits"] for i in ok),
        "oldest_created": min((i["created"] for i in ok if i["created"]), default=None),
        "newest_used": max((i["last_used"] or i["created"] for i in ok), default=None),
        "temp_files": len(tmps),
        "temp_bytes": _bytes_of(tmps),
    }
    if args.json:
        print(json.dumps(st, indent=1))
        return EXIT_OK
    _print_stats(st)
    return EXIT_OK


def _print_stats(st: Info) -> None:
    print(f"directory      {st['dir']}")
    print(
        f"files          {st['files']} ({st['ok']} ok" + "".join(f", {n} {s}" for s, n in st["unusable"].items()) + ")"
    )
    print(f"size           {human_bytes(st['bytes'])}")
    print(f"tokens         {st['tokens']}")
    print(f"hits           {st['hits']}")
    print("versions       " + ", ".join(f"v{k}: {n}" for k, n in st["by_version"].items()))
    print("reasons        " + ", ".join(f"{k}: {n}" for k, n in st["by_reason"].items()))
    for abi, n in st["by_abi"].items():
        print(f"abi            {n} x {abi}")
    if st["newest_used"]:
        print(f"last used      {age(st['newest_used'])}")
    print(f"temp files     {st['temp_files']} ({human_bytes(st['temp_bytes'])})")


KV_COMMANDS = {"ls": kv_ls, "show": kv_show, "verify": kv_verify, "gc": kv_gc, "rm": kv_rm, "stats": kv_stats}
