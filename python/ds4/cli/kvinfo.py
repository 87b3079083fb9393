"""What ``ds4 kv`` knows of one checkpoint file: :func:`inspect_file`
(the facts, and what the verification pipeline says of it), name
resolution inside a directory, and the ``kv show`` printout."""

from __future__ import annotations

import os
import stat
import sys
import time
from typing import Any

from ..checkpoint import open_checkpoint
from ..errors import CheckpointError
from ..keytext import ANONYMOUS, namespace_of, plain_text, tenant_of_namespace
from ..kvstore import NOT_REGULAR, Entry, scan_dir, stat_key
from .term import age, escaped, human_bytes, preview, table

__all__ = ["READABLE", "SHOW_KEYS", "UNVERIFIED", "Info", "inspect_file", "print_fields", "public", "resolve"]

Info = dict[str, Any]

#: the status of a file whose header, text and name verify but whose payload
#: was not checked: what a load decides is not known yet
UNVERIFIED = "unverified"
#: the statuses of a file whose header was read
READABLE = ("ok", UNVERIFIED)


def inspect_file(path: str, full: bool = False) -> Info:
    """Facts about one checkpoint file; ``full`` runs the whole pipeline
    (payload checksum and the arrays a load builds, with their token checks,
    for v2; DSV4 decode for v1)."""
    info: Info = {"name": os.path.basename(path), "path": path}
    try:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):  # the store's policy: ignored, never moved or deleted
            what = (
                "symlink" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else "special file"
            )
            reason = f"not a regular file: {what} (ignored)"
            info.update(status="ignored", error={"stage": "open", "code": NOT_REGULAR, "reason": reason})
            return info
        info["size"] = st.st_size
        info["_key"] = stat_key(st)  # the version judged: a discard removes this one only
        # mapped: the checksum streams over the map a window at a time, so a
        # payload of any size (or any claimed size) is verified in bounded memory
        ck = open_checkpoint(path, load_payload=full, verify_checksum=full)
        try:
            if full and ck.version >= 2:
                ck.load_arrays()  # the views and token checks every load makes before an engine
            ck.check_intact()
        finally:
            ck.release()
    except CheckpointError as e:
        info.update(status=e.kind, error={"stage": e.stage, "code": e.code, "reason": e.reason}, _error=e)
        return info
    except OSError as e:
        info.update(status="error", error={"stage": "open", "code": "os_error", "reason": str(e)})
        return info
    info.update(
        # "ok" is what a load would decide; a header alone does not say it
        status="ok" if full else UNVERIFIED,
        verified=full,
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
        preview=preview(plain_text(ck.text)),
        **_namespace(ck.text),
    )
    if ck.version >= 2:
        info["tensors"] = [
            {"name": n, "dtype": dt, "shape": list(sh), "offset": off, "bytes": nb}
            for (n, dt, sh, off, nb) in ck.tensor_table()
        ]
        info["payload_checksum"] = f"{ck.payload_checksum:016x}"
        info["raw_payload_bytes"] = ck.raw_payload_bytes
        info["codec"] = _codec(ck.codec, ck.codec_params)
        info["header_checksum"] = f"{ck.header_checksum:016x}"
    else:
        info["dsv4"] = dict(ck.dsv4) if ck.dsv4 else None
    info["_text"] = ck.text
    info["_entry"] = Entry.from_checkpoint(ck, path)
    return info


def _codec(codec: str, params: tuple[str, int, int, int] | None) -> str:
    """How the payload is stored: ``none`` (v2), or v3's codec, level,
    filter and frames (docs/FORMAT.md §1.10)."""
    if params is None:
        return codec
    filt, level, span, frames = params
    return f"{codec} level {level}, filter {filt}, {frames} frames of {human_bytes(span)}"


def _namespace(text: bytes) -> Info:
    """The cache namespace and tenant a stored key text names (never a key:
    a tenant is its name in the key file or a digest of its key). The
    default namespace's files are the anonymous tenant's, as the budget's
    shares count them (:attr:`ds4.kvstore.Entry.tenant`)."""
    try:
        ns, _ = namespace_of(text)
    except ValueError:
        return {"namespace": "?", "tenant": "?"}
    return {"namespace": ns, "tenant": tenant_of_namespace(ns) or ANONYMOUS}


def public(info: Info) -> Info:
    return {k: v for k, v in info.items() if not k.startswith("_")}


def resolve(d: str, name: str) -> tuple[str | None, str | None]:
    """A checkpoint path in ``d`` by file name or unique hex prefix. A name
    given as a path must lie in ``d``: nothing outside it is ever chosen."""
    if os.sep in name:
        if os.path.realpath(os.path.dirname(os.path.abspath(name))) != os.path.realpath(d):
            return None, f"{name!r} is not in {d}"
        name = os.path.basename(name)
    cks, _, other = scan_dir(d)
    cands = [p for p in cks + other if os.path.basename(p) in (name, name + ".kv")]
    if cands:
        return cands[0], None
    hits = [p for p in cks if os.path.basename(p).startswith(name.lower())] if name else []
    if len(hits) == 1:
        return hits[0], None
    return None, ("no checkpoint matches" if not hits else f"ambiguous ({len(hits)} files match)") + f" {name!r}"


SHOW_KEYS = (
    "name",
    "path",
    "status",
    "version",
    "reason",
    "tenant",
    "namespace",
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
    "raw_payload_bytes",
    "codec",
    "trailer_bytes",
    "abi",
    "header_checksum",
    "payload_checksum",
)


def print_fields(info: Info) -> None:
    for k in SHOW_KEYS:
        if k not in info:
            continue
        v = info[k]
        if k in ("created", "last_used") and v:
            v = f"{v} ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(v))}, {age(v)})"
        elif k == "size":
            v = f"{v} ({human_bytes(v)})"
        print(f"{k:16} {escaped(v)}")  # a name, an ABI string, a preview: the file's, escaped
    if info.get("error"):
        er = info["error"]
        print(f"{'error':16} {er['stage']}/{er['code']}: {escaped(er['reason'])}")
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
