"""A free TCP port on 127.0.0.1: the one copy, for the tests' servers (ds4
serve, redis-server) and the benches' (which put ``tests/`` on their path to
import it, as they import ``redis_servers`` and ``test_server``). No pytest
here, nothing of ds4: a bench can import it as a plain module."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick for port 0; another
    process may take it before the caller binds it, as with any such pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
