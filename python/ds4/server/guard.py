"""Who may talk to ``ds4 serve``: API keys, the trusted ``Host`` names and
the CORS origins, checked by one ASGI middleware before any route runs.

Order of the checks, for every HTTP request:

1. ``Host`` must be one of the allowed names (loopback names, the bound
   address, and every ``--allowed-host``; ``*`` allows any): a DNS-rebinding
   page reaches the server under its own name and gets 400 here.
2. A request with an ``Origin`` that is not a ``--cors-origin`` gets 403. With
   ``--cors-origin``, ``OPTIONS`` (a preflight) gets 204 and the CORS headers,
   and answers from an allowed origin carry ``Access-Control-Allow-Origin``.
   Without it, no CORS header is ever sent.
3. When keys are configured, every endpoint, ``/health`` included, needs
   one: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``; otherwise
   401 with OpenAI's error body. The presented key is hashed (SHA-256) and
   compared with every configured key's hash by :func:`hmac.compare_digest`,
   all of them, so the time taken says nothing about which key (or which
   prefix) is close. The web page's static files (``GET /ui``, its script
   and style sheet: no data in them) are the exception: they load without
   a key, and the page then sends one with each of its data requests.

The tenant of a request (``scope["state"]["ds4_tenant"]``) is its key's
name in ``--api-key-file`` or a digest of its key, never the key
(:mod:`ds4.server.tenants`). ``scope["state"]["ds4_operator"]`` says
whether the request may see the operator's view of ``/health`` (the
server-wide counters, the live session, the store): every request of a
server without keys, else only the keys of an ``--admin-tenant``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from typing import Any

from ..serve_args import add_guard_args
from .tenants import ANONYMOUS, load_tenant_keys, tenant_of

__all__ = [
    "ANONYMOUS",
    "Guard",
    "GuardMiddleware",
    "add_guard_args",
    "is_loopback",
    "load_keys",
    "tenant_of",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """True when binding ``host`` only accepts connections from this machine."""
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def load_keys(cli_keys: Sequence[str], key_file: str | None, env: MutableMapping[str, str] | None = None) -> list[str]:
    """Every configured key (see :func:`ds4.server.tenants.load_tenant_keys`)."""
    return [k for k, _ in load_tenant_keys(cli_keys, key_file, env)]


def _host_name(value: str) -> str:
    """The name part of a ``Host`` header (port and IPv6 brackets removed)."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1 : v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


class Guard:
    """The configuration the middleware enforces."""

    def __init__(
        self,
        keys: Iterable[str | tuple[str, str]] = (),
        *,
        allowed_hosts: Iterable[str] = (),
        cors_origins: Iterable[str] = (),
        bind_host: str | None = None,
        admin_tenants: Iterable[str] = (),
    ):
        # Only digests are kept: (sha256(key), tenant) per key; a bare key's
        # tenant is derived from it, a (key, tenant) pair names it.
        pairs = [(k, tenant_of(k)) if isinstance(k, str) else k for k in keys]
        self._keys = [(hashlib.sha256(k.encode("utf-8")).digest(), t) for k, t in pairs]
        self.admins = frozenset(admin_tenants)
        unknown = sorted(self.admins - {t for _, t in self._keys})
        if unknown:
            raise ValueError(f"--admin-tenant names no tenant of the configured keys: {', '.join(unknown)}")
        hosts = {h.lower().strip("[]") for h in (*LOOPBACK_NAMES, *allowed_hosts)}
        if bind_host and bind_host not in ("0.0.0.0", "::", ""):
            hosts.add(bind_host.lower().strip("[]"))
        self.any_host = "*" in hosts
        self.hosts = frozenset(hosts - {"*"})
        self.cors = frozenset(cors_origins)
        self.any_origin = "*" in self.cors

    @property
    def needs_key(self) -> bool:
        return bool(self._keys)

    def operator(self, tenant: str) -> bool:
        """Whether ``tenant`` sees the operator's view: every request
        without keys (one user), else an ``--admin-tenant``'s keys only."""
        return not self._keys or tenant in self.admins

    def host_ok(self, host: str | None) -> bool:
        return self.any_host or (host is not None and _host_name(host) in self.hosts)

    def origin_ok(self, origin: str | None) -> bool:
        return origin is None or self.any_origin or origin in self.cors

    def tenant(self, presented: str | None) -> str | None:
        """The tenant of ``presented``, ``ANONYMOUS`` without keys, None when
        refused. Every configured key is compared (constant time each)."""
        if not self._keys:
            return ANONYMOUS
        digest = hashlib.sha256((presented or "").encode("utf-8", "surrogatepass")).digest()
        found = None
        for d, t in self._keys:
            if hmac.compare_digest(d, digest) and presented is not None:
                found = t
        return found


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    """The key a request presents: ``Authorization: Bearer`` or ``x-api-key``."""
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, value = auth.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    xk = headers.get(b"x-api-key")
    return xk.decode("latin-1").strip() if xk else None


def _error(message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class GuardMiddleware:
    """The checks of :class:`Guard`, in front of the whole app."""

    def __init__(self, app: ASGIApp, guard: Guard, open_paths: Iterable[str] = ()):
        self.app, self.guard = app, guard
        self.open_paths = frozenset(open_paths)  # served without a key (the web page's static files)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        g = self.guard
        headers = {k.lower(): v for k, v in scope["headers"]}
        host = headers.get(b"host", b"").decode("latin-1") or None
        origin_b = headers.get(b"origin")
        origin = origin_b.decode("latin-1") if origin_b is not None else None
        if not g.host_ok(host):
            await _reply(
                send, 400, _error("the Host header names no allowed host", "invalid_request_error", "invalid_host")
            )
            return
        if not g.origin_ok(origin):
            await _reply(
                send,
                403,
                _error("cross-origin requests are not allowed", "invalid_request_error", "origin_not_allowed"),
            )
            return
        cors = self._cors_headers(origin)
        if scope["method"] == "OPTIONS" and g.cors:
            await _reply(send, 204, b"", cors + self._preflight_headers(headers))
            return
        if scope["path"] in self.open_paths and scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, self._with_headers(send, cors) if cors else send)
            return
        tenant = g.tenant(presented_key(headers))
        if tenant is None:
            body = _error(
                "Incorrect or missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key'",
                "invalid_request_error",
                "invalid_api_key",
            )
            await _reply(send, 401, body, [*cors, (b"www-authenticate", b"Bearer")])
            return
        state = scope.setdefault("state", {})
        state["ds4_tenant"] = tenant
        state["ds4_operator"] = g.operator(tenant)
        await self.app(scope, receive, self._with_headers(send, cors) if cors else send)

    def _cors_headers(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        if origin is None or not self.guard.cors:
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    @staticmethod
    def _preflight_headers(headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        asked = headers.get(b"access-control-request-headers", b"")
        allow = b"authorization, content-type, x-api-key" + (b", " + asked if asked else b"")
        return [
            (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
            (b"access-control-allow-headers", allow),
            (b"access-control-max-age", b"600"),
        ]

    @staticmethod
    def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        return wrapped


async def _reply(send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    hs = [*headers]
    if body:
        hs += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body})


def guard_from_args(args: Any, env: MutableMapping[str, str] | None = None) -> Guard:
    """The :class:`Guard` of ``ds4 serve``'s flags; ValueError when the
    flags are refused (a non-loopback ``--host`` without a key, a bad key)."""
    try:
        keys = load_tenant_keys(args.api_key, args.api_key_file, env)
    except OSError as e:
        raise ValueError(f"cannot read --api-key-file: {e.strerror}") from None
    if not keys and not is_loopback(args.host) and not args.insecure_no_auth:
        raise ValueError(
            f"--host {args.host} accepts connections from other machines: give --api-key, --api-key-file "
            "or DS4_API_KEY (or --insecure-no-auth to serve without a key)"
        )
    if args.admin_tenant and not keys:
        raise ValueError("--admin-tenant needs keys (without keys every request sees the operator's /health)")
    return Guard(
        keys,
        allowed_hosts=args.allowed_host,
        cors_origins=args.cors_origin,
        bind_host=args.host,
        admin_tenants=args.admin_tenant,
    )
