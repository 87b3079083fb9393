"""``ds4 kv``: inspect, verify and clean a checkpoint directory (ds4's v1
files too: every file goes through :func:`ds4.open_checkpoint`, which reads
both formats). What is removed is removed by :class:`ds4.KVStore`, under
the directory's lock; the inspection commands change nothing."""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
import sys
import time

from ..config import DEFAULT_BUDGET_MB, check_policy_args
from ..keytext import plain_text
from ..kvstore import (
    KVStore,
    StorePolicy,
    remove_orphaned_temp,
    scan_dir,
    temp_is_orphaned,
    tenant_usage,
)
from . import plot
from .kvblocks import Manifests, annotate, block_files, blocks_cell, manifest_line, plan_evict
from .kvinfo import READABLE, UNVERIFIED, Info, inspect_file, print_fields, public, resolve
from .kvmodels import model_filter, model_label, model_of, of_model
from .kvremove import kv_prune, kv_rm
from .kvverify import kv_verify
from .term import EXIT_FAIL, EXIT_OK, EXIT_USAGE, age, escaped, human_bytes, json_text, printable, table

__all__ = ["KV_COMMANDS", "inspect_file"]


NOT_VERIFIED = "unverified: header, text and name checked, payload not (--verify, or ds4 kv verify, decides as a load)"


def _not_a_dir(d: str) -> bool:
    """True (after saying so on stderr) when ``d`` is not a directory."""
    if os.path.isdir(d):
        return False
    print(f"ds4 kv: {d}: not a directory", file=sys.stderr)
    return True


def _ls_row(i: Info, now: float) -> list[str]:
    if "version" in i:  # its header was read (a manifest whose block failed too)
        return [
            i["name"][:12],
            i["tenant"],
            model_label(str(i.get("abi", ""))),
            f"v{i['version']}",
            i["reason"],
            str(i["tokens"]),
            human_bytes(i["size"]),
            str(i["hits"]),
            age(i["last_used"] or i["created"], now),
            i["status"] if i["status"] in READABLE else f"{i['status']}:{i['error']['code']}",
            i["preview"],
        ]
    err = i["error"]
    return [
        i["name"][:12],
        "?",
        "?",
        "?",
        "?",
        "?",
        human_bytes(i.get("size", 0)),
        "?",
        "?",
        f"{i['status']}:{err['code']}",
        err["reason"][:48],
    ]


def kv_ls(args: argparse.Namespace) -> int:
    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    fp = model_filter(args, "ds4 kv ls")
    if fp is False:
        return EXIT_USAGE
    cks, tmps, other = scan_dir(d)
    infos = [inspect_file(p, full=args.verify) for p in cks + other]
    m = annotate(infos, d, args.verify)  # every file's: what is shared counts the other models' too
    infos = of_model(infos, fp) if isinstance(fp, str) else infos
    infos.sort(key=lambda i: (-(i.get("last_used") or 0), i["name"]))
    if args.json:
        files = [{**public(i), "model": model_of(str(i.get("abi", "")))} for i in infos]
        print(json_text({"dir": os.path.abspath(d), "files": files, "temp_files": [os.path.basename(t) for t in tmps]}))
        return EXIT_OK
    now = time.time()
    head = ["NAME", "TENANT", "MODEL", "VER", "REASON", "TOKENS", "SIZE", "HITS", "LAST USED", "STATUS", "TEXT"]
    rows = [_ls_row(i, now) for i in infos]
    if any(i.get("manifest") for i in infos):  # a BLOCKS column before the text
        head.insert(-1, "BLOCKS")
        rows = [[*r[:-1], blocks_cell(i), r[-1]] for r, i in zip(rows, infos, strict=True)]
    table(rows, head, sys.stdout)
    total = sum(i.get("size", 0) for i in infos)
    print(f"{len(infos)} files, {human_bytes(total)}" + (f", {len(tmps)} temp files" if tmps else ""))
    if m.files:
        orphans = m.orphans()
        print(
            f"{len(m.files)} block files, {human_bytes(sum(m.files.values()))}"
            + (f", {len(orphans)} named by no manifest (ds4 kv gc removes them)" if orphans else "")
        )
    if any(i["status"] == UNVERIFIED for i in infos):
        print(NOT_VERIFIED)
    return EXIT_OK


def _show_path(args: argparse.Namespace) -> tuple[str | None, int]:
    d = args.dir
    if os.path.isfile(d) and not args.name:
        return d, EXIT_OK
    if _not_a_dir(d):
        return None, EXIT_USAGE
    if not args.name:
        print("ds4 kv show: give a checkpoint name (or a unique prefix)", file=sys.stderr)
        return None, EXIT_USAGE
    path, why = resolve(d, args.name)
    if path is None:
        print(f"ds4 kv show: {why}", file=sys.stderr)
        return None, EXIT_FAIL
    return path, EXIT_OK


def kv_show(args: argparse.Namespace) -> int:
    path, rc = _show_path(args)
    if path is None:
        return rc
    info = inspect_file(path, full=args.verify)
    annotate([info], os.path.dirname(os.path.abspath(path)), args.verify, whole=False)
    text = info.pop("_text", None)
    status = EXIT_OK if info["status"] in READABLE else EXIT_FAIL
    if args.json:
        out = public(info)
        if text is not None:
            out["text"] = plain_text(text).decode("utf-8", "replace")
        print(json_text(out))
        return status
    print_fields(info)
    line = manifest_line(info)
    if line is not None:
        print(f"{'manifest':16} {line}")
    if info["status"] == UNVERIFIED:
        print(NOT_VERIFIED)
    if text is not None:
        s = plain_text(text).decode("utf-8", "replace")
        if not args.text and len(s) > 400:
            s = s[:200] + f"\n… ({len(text)} bytes; --text shows all) …\n" + s[-200:]
        print("text:")
        print(printable(s))
    return status


def _bytes_of(paths: list[str]) -> int:
    """Bytes of the regular files among ``paths`` (a symlink's target is not
    the directory's)."""
    total = 0
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


class _Gc:
    """One ``ds4 kv gc`` run: corrupt files out (or quarantined), orphaned
    temp files out, block files no manifest names out, then eviction to a
    budget (with the blocks only the evicted named), all by the store's
    policy. With ``dry_run`` nothing changes and the same decisions are reported."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.d, self.now = args, args.dir, time.time()
        budget = args.budget_mb if args.budget_mb is not None else 1 << 40
        # an explicit clean-up of a named directory (ds4-server's, another
        # user's): it loads nothing into a session, so the directory's owner
        # is not what matters here
        self.store = KVStore(
            self.d,
            budget_mb=budget,
            min_tokens=1,
            quarantine_dir=args.quarantine_dir,
            scan=False,
            trust_dir=True,
            tenant_share=args.tenant_share or 1.0,
            # None: the flag not given, the server's default
            explicit_weight=StorePolicy.explicit_weight if args.kv_explicit_weight is None else args.kv_explicit_weight,
            fresh_guard_s=StorePolicy.fresh_guard_s if args.kv_fresh_guard_s is None else args.kv_fresh_guard_s,
        )
        self.removed: list[Info] = []
        self.quarantined: list[str] = []
        self.tmp_removed: list[str] = []
        self.evicted: list[str] = []
        self.kept: list[Info] = []
        self.live: list[Info] = []  # what stays of the checkpoints (their tables name the blocks kept)
        self.changed = False  # a file changed under the verdict: which blocks it names is not known
        self.orphans: list[str] = []
        self.evicted_blocks = 0
        self.manifests = Manifests(self.d)

    def corrupt(self, cks: list[str]) -> None:
        for p in cks:
            i = inspect_file(p, full=True)
            if i["status"] == "corrupt":
                if not self.args.dry_run:
                    moved = self.store.discard(p, i["_error"], "gc", i["_key"])
                    if moved is None:
                        self.changed = True
                        continue
                    if self.args.quarantine_dir:
                        self.quarantined.append(i["name"])
                self.removed.append({"name": i["name"], **i["error"]})
                continue
            if i["status"] != "ok":
                self.kept.append({"name": i["name"], "status": i["status"], **i["error"]})
            self.live.append(i)

    def blocks(self) -> None:
        """The block files no remaining checkpoint names (a crashed save's,
        a removed manifest's) out; none while a file could not be read."""
        m = self.manifests
        for i in self.live:
            m.add_info(i, False)
        m.unknown |= self.changed
        self.orphans = m.orphans() or []
        if self.orphans and not self.args.dry_run:
            self.store.blocks.remove(self.orphans, "orphans")

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
        if self.args.dry_run:  # the store's plan (limit, shares, order), without unlinking
            # what the index would hold once the corrupt files are out: every
            # readable header's entry, with the stat key (its mtime breaks ties)
            gone = {r["name"] for r in self.removed}
            infos = (inspect_file(p) for p in scan_dir(self.d)[0])
            ents = [
                dataclasses.replace(i["_entry"], stat_key=i["_key"])
                for i in infos
                if i["status"] in READABLE and i["name"] not in gone
            ]
            self.evicted, self.evicted_blocks = plan_evict(self.store, ents, self.manifests, self.orphans)
            return
        n = self.store.blocks.counts["orphans"]
        self.evicted = self.store.evict_names()
        self.evicted_blocks = self.store.blocks.counts["orphans"] - n  # those only the evicted named

    def report(self, before: int, after: int) -> None:
        args = self.args
        out = {
            "dir": os.path.abspath(self.d),
            "dry_run": args.dry_run,
            "removed_corrupt": self.removed,
            "quarantined": self.quarantined,
            "removed_temp": self.tmp_removed,
            "removed_orphan_blocks": self.orphans,
            "evicted": self.evicted,
            "evicted_blocks": self.evicted_blocks,
            "kept_unusable": self.kept,
            "bytes_before": before,
            "bytes_after": after,
        }
        if args.json:
            print(json_text(out))
            return
        verb = "would remove" if args.dry_run else "removed"
        for r in self.removed:
            print(f"{verb} corrupt {escaped(r['name'])}: {r['stage']}/{r['code']}: {escaped(r['reason'])}")
        for t in self.tmp_removed:
            print(f"{verb} orphaned temp file {escaped(t)}")
        for h in self.orphans:
            print(f"{verb} orphan block {h}")
        for n in self.evicted:
            print(f"{'would evict' if args.dry_run else 'evicted'} {escaped(n)}")
        if self.evicted_blocks:
            print(f"{verb} {self.evicted_blocks} blocks only the evicted checkpoints named")
        for k in self.kept:
            print(f"kept {escaped(k['name'])} ({k['status']}: {k['code']})")
        print(
            f"{len(self.removed)} corrupt, {len(self.tmp_removed)} temp, {len(self.orphans)} orphan blocks, "
            f"{len(self.evicted)} evicted; "
            f"{human_bytes(before)} -> {human_bytes(after)}"
        )


def kv_gc(args: argparse.Namespace) -> int:
    if _not_a_dir(args.dir):
        return EXIT_USAGE
    if args.tenant_share is not None and args.budget_mb is None:
        print("ds4 kv gc: --tenant-share is a share of --budget-mb: give both", file=sys.stderr)
        return EXIT_USAGE
    bad = check_policy_args(args)
    if bad is not None:
        print(f"ds4 kv gc: {bad}", file=sys.stderr)
        return EXIT_USAGE
    gc = _Gc(args)
    # the directory's lock for the whole run: a lock file that cannot be
    # taken (a symlink, a FIFO) stops gc before anything changes, naming it
    with gc.store.locked():
        cks, tmps, _ = scan_dir(args.dir)
        before = _bytes_of(cks) + sum(block_files(args.dir).values())
        gc.corrupt(cks)
        gc.temps(tmps)
        gc.blocks()
        gc.evict()
        after = _bytes_of(scan_dir(args.dir)[0]) + sum(block_files(args.dir).values())
    gc.report(before, after)
    return EXIT_OK


def _counts(infos: list[Info], key: str) -> dict[str, int]:
    return {k: sum(1 for i in infos if str(i[key]) == k) for k in sorted({str(i[key]) for i in infos})}


def kv_stats(args: argparse.Namespace) -> int:
    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    refused = plot.refuse(args)  # before anything is printed
    if refused is not None:
        return refused
    cks, tmps, other = scan_dir(d)
    infos = [inspect_file(p, full=args.verify) for p in cks + other]
    m = annotate(infos, d, args.verify)
    ok = [i for i in infos if i["status"] in READABLE]  # the facts below are the headers'
    bad = [i["status"] for i in infos if i["status"] not in READABLE]
    st = {
        "dir": os.path.abspath(d),
        "files": len(infos),
        "ok": sum(1 for i in ok if i["status"] == "ok"),
        "unverified": sum(1 for i in ok if i["status"] == UNVERIFIED),
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
        "tenants": tenant_usage((i["_entry"].namespace, i["size"], 1) for i in ok),
        **m.totals(infos),
    }
    if args.tenant_share is not None:
        _shares(st, d, args)
    if args.json:
        print(json_text(st))
    else:
        _print_stats(st)
    return plot.draw(args.plot, st, ok) if args.plot is not None else EXIT_OK


def _shares(st: Info, d: str, args: argparse.Namespace) -> None:
    """Each tenant's share of the budget (F of what the records leave of
    it, as the store's eviction counts it) and whether it holds more."""
    budget_mb = DEFAULT_BUDGET_MB if args.budget_mb is None else args.budget_mb
    # opened for its limit only: no scan, nothing read, moved or evicted
    store = KVStore(d, budget_mb=budget_mb, scan=False, trust_dir=True, tenant_share=args.tenant_share)
    share = int(store.tenant_share * store.eviction_limit())
    st.update(budget_bytes=store.budget_bytes, tenant_share=store.tenant_share, share_bytes=share)
    for t in st["tenants"].values():
        t["over_share"] = t["bytes"] > share


def _print_tenants(st: Info) -> None:
    share = st.get("share_bytes")
    if share is not None:
        print(
            f"tenant share   {st['tenant_share']:g} of {human_bytes(st['budget_bytes'])} "
            f"(less the records): {human_bytes(share)} each"
        )
    rows = [
        [name, str(t["checkpoints"]), human_bytes(t["bytes"])]
        + ([f"{t['bytes'] / max(1, share):.0%}", "OVER" if t["over_share"] else "ok"] if share is not None else [])
        for name, t in st["tenants"].items()
    ]
    head = ["TENANT", "CHECKPOINTS", "SIZE"] + (["OF SHARE", "SHARE"] if share is not None else [])
    table(rows, head, sys.stdout)


def _print_stats(st: Info) -> None:
    print(f"directory      {escaped(st['dir'])}")
    parts = [f"{st['ok']} ok"] + ([f"{st['unverified']} unverified"] if st["unverified"] else [])
    parts += [f"{n} {s}" for s, n in st["unusable"].items()]
    print(f"files          {st['files']} ({', '.join(parts)})")
    print(f"size           {human_bytes(st['bytes'])}")
    print(f"tokens         {st['tokens']}")
    print(f"hits           {st['hits']}")
    print("versions       " + ", ".join(f"v{k}: {n}" for k, n in st["by_version"].items()))
    print("reasons        " + ", ".join(f"{escaped(k)}: {n}" for k, n in st["by_reason"].items()))
    for abi, n in st["by_abi"].items():
        print(f"abi            {n} x {escaped(abi)}")
    if st["newest_used"]:
        print(f"last used      {age(st['newest_used'])}")
    print(f"temp files     {st['temp_files']} ({human_bytes(st['temp_bytes'])})")
    if st["manifests"] or st["block_files"]:
        orphans = st["orphan_blocks"]
        print(f"manifests      {st['manifests']} ({human_bytes(st['manifest_bytes'])})")
        print(
            f"blocks         {st['block_files']} ({human_bytes(st['block_files_bytes'])})"
            + (f", {orphans} named by no manifest" if orphans else "")
        )
        print(
            f"dedup          {st['dedup_ratio']:.2f}x: {human_bytes(st['single_file_bytes'])} as single files, "
            f"{human_bytes(st['disk_bytes'])} on disk"
        )
    if st["tenants"]:
        _print_tenants(st)
    if st["unverified"]:
        print(NOT_VERIFIED)


KV_COMMANDS = {
    "ls": kv_ls,
    "show": kv_show,
    "verify": kv_verify,
    "gc": kv_gc,
    "rm": kv_rm,
    "prune": kv_prune,
    "stats": kv_stats,
}
