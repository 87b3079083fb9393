"""``ds4 kv ls|stats|verify|gc|rm --remote URL``, ``ds4 kv push DIR
--remote URL`` and ``ds4 kv pull DIR --remote URL``: the shared tier seen
from the terminal. What is read, uploaded, downloaded or deleted goes
through :class:`ds4.kvstore.remote.RemoteTier` and :class:`ds4.KVStore`
(downloads are verified there, as any load)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import add_remote_args, read_auth_key
from ..errors import RemoteTierError
from ..kvstore import KVStore
from ..kvstore.rejection import RejectionLog

if TYPE_CHECKING:  # the tier's client is imported by the commands that use it, not by the parser
    from ..kvstore.remote import RemoteEntry, RemoteTier
from .term import EXIT_FAIL, EXIT_OK, EXIT_USAGE, escaped, human_bytes, json_text, report_removed, table

__all__ = ["REMOTE_COMMANDS", "add_remote_args"]


def _report() -> RejectionLog:
    """A ladder's report to collect a download's rejections in (imported
    here: the ladder's module loads the session and numpy, which the
    directory's commands, ``ds4 kv lookup`` above all, never need)."""
    from ..recovery import RecoveryReport

    return RecoveryReport()


def _tier(args: argparse.Namespace) -> RemoteTier:
    from ..kvstore.remote import RemoteTier

    return RemoteTier(args.remote, namespace=args.namespace, fail_threshold=1, cooldown_s=0)


def _row(e: RemoteEntry) -> list[str]:
    return [e.name[:12], str(e.tokens), str(e.text_bytes), human_bytes(e.size), str(len(e.digests)), e.abi[:40]]


def _entry_json(e: RemoteEntry) -> dict[str, object]:
    return {
        "name": e.name,
        "abi": e.abi,
        "tokens": e.tokens,
        "text_bytes": e.text_bytes,
        "size": e.size,
        "chunks": len(e.digests),
    }


def remote_ls(args: argparse.Namespace) -> int:
    tier = _tier(args)
    try:
        found = tier.scan()
    finally:
        tier.close()
    entries = sorted(found.entries, key=lambda e: (e.abi, -e.text_bytes, e.name))
    if args.json:
        doc = {
            "remote": tier.url,
            "namespace": tier.namespace,
            "files": [_entry_json(e) for e in entries],
            "gone": len(found.gone),
            "damaged": [{"index": i, "member": m, "reason": r} for i, m, r in found.damaged],
        }
        print(json_text(doc))
        return EXIT_OK
    table([_row(e) for e in entries], ["NAME", "TOKENS", "TEXT", "SIZE", "CHUNKS", "ABI"], sys.stdout)
    print(
        f"{len(entries)} remote checkpoints, {human_bytes(sum(e.size for e in entries))}"
        + (f", {len(found.gone)} index entries gone" if found.gone else "")
        + (f", {len(found.damaged)} damaged manifests" if found.damaged else "")
    )
    return EXIT_OK


def remote_stats(args: argparse.Namespace) -> int:
    tier = _tier(args)
    try:
        found = tier.scan()
    finally:
        tier.close()
    by_abi: dict[str, dict[str, int]] = {}
    for e in found.entries:
        d = by_abi.setdefault(e.abi, {"files": 0, "bytes": 0, "tokens": 0})
        d["files"] += 1
        d["bytes"] += e.size
        d["tokens"] += e.tokens
    total = sum(e.size for e in found.entries)
    doc = {
        "remote": tier.url,
        "namespace": tier.namespace,
        "files": len(found.entries),
        "bytes": total,
        "gone": len(found.gone),
        "damaged": len(found.damaged),
        "blocks": found.blocks,
        "block_bytes": found.block_bytes,
        "orphan_blocks": len(found.orphans),
        "by_abi": by_abi,
    }
    if args.json:
        print(json_text(doc))
    else:
        print(f"remote {tier.url} namespace {escaped(tier.namespace)}")
        print(f"{doc['files']} checkpoints, {human_bytes(total)}, {doc['gone']} gone, {doc['damaged']} damaged")
        if found.blocks:
            print(f"{found.blocks} shared blocks, {human_bytes(found.block_bytes)}, {len(found.orphans)} named by none")
        for abi, d in sorted(by_abi.items()):
            print(f"  {escaped(abi)}: {d['files']} files, {human_bytes(d['bytes'])}, {d['tokens']} tokens")
    return EXIT_OK


def remote_verify(args: argparse.Namespace) -> int:
    """Download every remote checkpoint into a scratch directory and run the
    whole pipeline (and the tensor checks of a load) on it. A damaged one is
    deleted from the tier, as a load would; exit 1 when any failed."""
    key = read_auth_key(args.kv_auth_key_file)
    tier = _tier(args)
    failed: list[tuple[str, str, str]] = []
    ok = 0
    try:
        found = tier.scan()
        with tempfile.TemporaryDirectory(prefix="ds4-kv-verify-") as scratch:
            store = KVStore(scratch, remote=tier, auth_key=key, scan=False)
            for e in found.entries:
                rep = _report()
                if store.pull(e, rep) is not None:
                    ok += 1
                    store.remove(e.name)  # the scratch directory holds one checkpoint at a time
                else:
                    why = rep.rejected[0] if rep.rejected else ("", "remote", "unavailable", tier.state)
                    failed.append((e.name, why[2], why[3]))
    finally:
        tier.close()
    failed += [(m, "remote_manifest", r) for _, m, r in found.damaged]
    if args.json:
        print(json_text({"ok": ok, "failed": [{"name": n, "code": c, "reason": r} for n, c, r in failed]}))
    else:
        for n, c, r in failed:
            print(f"{escaped(n[:12])}  {c}: {escaped(r)}")
        print(f"{ok} verified, {len(failed)} failed")
    return EXIT_FAIL if failed else EXIT_OK


def remote_gc(args: argparse.Namespace) -> int:
    """Prune index entries whose checkpoint is gone (with any chunks left
    behind), delete checkpoints whose manifest does not parse, and shared
    blocks no manifest names (stored longer ago than an upload takes)."""
    tier = _tier(args)
    try:
        found = tier.scan()
        pruned = deleted = orphans = 0
        if not args.dry_run:
            for index, member in found.gone:  # the member, and any chunks the manifest left behind
                tier.delete_member(index, member)
                pruned += 1
            for i, m, _ in found.damaged:
                tier.delete_member(i, m)
                deleted += 1
            for abi_id, block, _ in found.orphans:
                orphans += tier.delete_block(block, "", abi_id=abi_id)
    finally:
        tier.close()
    doc = {"gone": len(found.gone), "damaged": len(found.damaged), "pruned": pruned, "deleted": deleted}
    doc.update(orphan_blocks=len(found.orphans), orphan_bytes=sum(n for *_, n in found.orphans), removed_blocks=orphans)
    if args.json:
        print(json_text({**doc, "dry_run": args.dry_run}))
    else:
        verb = "would prune" if args.dry_run else "pruned"
        print(f"{verb} {len(found.gone)} index entries, {len(found.damaged)} damaged checkpoints")
        if found.orphans:
            print(
                f"{'would remove' if args.dry_run else 'removed'} {len(found.orphans)} shared blocks no checkpoint names"
            )
    return EXIT_OK


def remote_rm(args: argparse.Namespace) -> int:
    if not args.names and not args.all:
        print("ds4 kv rm --remote: give names (or unique prefixes) or --all", file=sys.stderr)
        return EXIT_USAGE
    tier = _tier(args)
    try:
        entries = tier.scan().entries
        chosen = entries if args.all else [e for e in entries if any(e.name.startswith(n) for n in args.names)]
        unknown = [n for n in args.names if not any(e.name.startswith(n) for e in entries)]
        removed = [e.name for e in chosen if tier.delete(e.sha, e.abi, e)]
    finally:
        tier.close()
    return report_removed(
        args.json, removed, "unknown", unknown, "ds4 kv rm --remote", lambda n: f"no remote checkpoint {n}"
    )


def _dir_store(args: argparse.Namespace, tier: RemoteTier) -> KVStore:
    return KVStore(args.dir, remote=tier, auth_key=read_auth_key(args.kv_auth_key_file), trust_dir=args.kv_trust_dir)


def remote_push(args: argparse.Namespace) -> int:
    tier = _tier(args)
    try:
        store = _dir_store(args, tier)
        counts = store.push()
    finally:
        tier.close()
    print(json.dumps(counts) if args.json else ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "nothing")
    return EXIT_FAIL if counts.get("failed") or counts.get("skipped") else EXIT_OK


def remote_pull(args: argparse.Namespace) -> int:
    tier = _tier(args)
    pulled: list[str] = []
    failed: list[str] = []
    try:
        store = _dir_store(args, tier)
        entries = tier.scan().entries
        if args.names:
            entries = [e for e in entries if any(e.name.startswith(n) for n in args.names)]
        have = {e.name for e in store.entries()}
        for e in entries:
            if e.name in have:
                continue
            rep = _report()
            (pulled if store.pull(e, rep) is not None else failed).append(e.name)
    except RemoteTierError as err:
        print(f"ds4 kv pull: {err}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        tier.close()
    if args.json:
        print(json_text({"pulled": pulled, "failed": failed}))
    else:
        print(f"{len(pulled)} pulled, {len(failed)} rejected")
    return EXIT_FAIL if failed else EXIT_OK


REMOTE_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": remote_ls,
    "stats": remote_stats,
    "verify": remote_verify,
    "gc": remote_gc,
    "rm": remote_rm,
    "push": remote_push,
    "pull": remote_pull,
}
