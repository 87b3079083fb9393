"""Tenants of ``ds4 serve`` (issue 11, item 2): who a key belongs to, and
the cache namespace a request's turn runs in.

* Every key is a tenant. In ``--api-key-file`` a line ``name:key`` names
  the tenant (``name``: letters, digits, ``.``, ``_``, ``-``; at most 64;
  not ``anonymous``, not starting with ``key-``); a bare ``key`` line, an
  ``--api-key`` and ``DS4_API_KEY`` get ``key-`` and 16 hex digits of a
  domain-separated SHA-256 of the key (:func:`tenant_of`): stable across
  restarts, never the key. Without keys every request is ``anonymous``.
* A request may add ``cache_salt`` (vLLM's field; a body field on chat,
  completions, ``/v1/messages`` and ``/v1/responses``): the turn's namespace is
  then ``<tenant>/salt-<16 hex of a domain-separated SHA-256 of the salt>``
  (:func:`namespace_for`). The salt itself is never stored.
* The namespace enters the checkpoint key (:mod:`ds4.keytext`): tenants and
  salts never share a checkpoint nor the live session's reuse. Anonymous
  requests without a salt use the default namespace (the keys ds4 has
  always written).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import MutableMapping, Sequence

from ..keytext import ANONYMOUS

__all__ = ["ANONYMOUS", "load_tenant_keys", "namespace_for", "parse_key_line", "tenant_of"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TENANT_DOMAIN = b"ds4 tenant v1\x00"
_SALT_DOMAIN = b"ds4 cache_salt v1\x00"


def tenant_of(key: str) -> str:
    """The tenant of an unnamed key: ``key-`` and 16 hex digits of a
    domain-separated SHA-256 of the key (shown in logs and ``ds4 kv ls``,
    stored in checkpoint keys; the key itself never is)."""
    return "key-" + hashlib.sha256(_TENANT_DOMAIN + key.encode("utf-8")).hexdigest()[:16]


def namespace_for(tenant: str, cache_salt: str | None = None) -> str | None:
    """The cache namespace of a turn: None (the default) for an anonymous
    request without a salt, else the tenant, with ``/salt-<digest>`` when a
    ``cache_salt`` is given."""
    if not cache_salt:
        return None if tenant == ANONYMOUS else tenant
    digest = hashlib.sha256(_SALT_DOMAIN + cache_salt.encode("utf-8")).hexdigest()[:16]
    return f"{tenant}/salt-{digest}"


def _check_key(key: str) -> str:
    if not key or any(c.isspace() for c in key):
        raise ValueError("an API key must be non-empty and contain no whitespace")
    return key


def parse_key_line(line: str) -> tuple[str, str] | None:
    """(key, tenant) of one ``--api-key-file`` line: ``name:key`` or ``key``;
    None for a blank line or a ``#`` comment. ValueError for a bad name or
    key (the message never shows the key)."""
    s = line.strip()
    if not s or s.startswith("#"):
        return None
    name, sep, key = s.partition(":")
    if not sep:
        return _check_key(s), tenant_of(s)
    if not _NAME_RE.match(name) or name == ANONYMOUS or name.startswith("key-"):
        raise ValueError(
            f"bad tenant name {name!r}: letters, digits, '.', '_', '-' (at most 64), "
            f"not {ANONYMOUS!r}, not starting with 'key-'"
        )
    return _check_key(key), name


def load_tenant_keys(
    cli_keys: Sequence[str], key_file: str | None, env: MutableMapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """Every configured (key, tenant): ``--api-key`` (repeatable), the lines
    of ``--api-key-file`` and ``DS4_API_KEY``. ValueError on a bad key or
    name, or one key given to two tenants."""
    env = os.environ if env is None else env
    pairs = [(_check_key(k), tenant_of(k)) for k in cli_keys]
    if key_file:
        with open(key_file, encoding="utf-8") as f:
            pairs += [p for p in (parse_key_line(ln) for ln in f) if p is not None]
    if env.get("DS4_API_KEY"):
        k = env["DS4_API_KEY"]
        pairs.append((_check_key(k), tenant_of(k)))
    out: dict[str, str] = {}
    for k, t in pairs:
        prev = out.get(k)
        if prev is not None and prev != t and not (prev.startswith("key-") or t.startswith("key-")):
            raise ValueError(f"one key is given to two tenants ({prev!r} and {t!r})")
        if prev is None or prev.startswith("key-"):  # a name wins over the derived id
            out[k] = t
    return list(out.items())
